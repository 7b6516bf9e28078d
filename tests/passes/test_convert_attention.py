"""AttentionConversionPass on hand-built opset-23 graphs (RotaryEmbedding + Attention), against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_attention import ConvertAttention

pytestmark = pytest.mark.unit

B, S, P, HIDDEN, HEADS, KV_HEADS, D = 2, 5, 3, 32, 4, 2, 8
RNG = np.random.default_rng(7)


def _model(four_d: bool, interleaved: int = 0, rotary_dim: int = 0, past: bool = True, mask: str = "",
           causal: int = 1, k_rotary_dim: int | None = None):
    half = (rotary_dim or D) // 2
    angles = np.arange(64)[:, None] * (0.1 + np.arange(half))[None, :] * 0.05
    init = [numpy_helper.from_array((0.3 * RNG.standard_normal((HIDDEN, n))).astype(np.float32), name)
            for name, n in (("wq", HEADS * D), ("wk", KV_HEADS * D), ("wv", KV_HEADS * D))]
    init += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}3"]) for n in "qkv"]
    shapes = {}
    for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        if four_d:
            init.append(numpy_helper.from_array(np.array([0, 0, heads, D], np.int64), f"{name}_shape"))
            nodes += [helper.make_node("Reshape", [f"{name}3", f"{name}_shape"], [f"{name}s"]),
                      helper.make_node("Transpose", [f"{name}s"], [f"{name}4"], perm=[0, 2, 1, 3])]
        shapes[name] = f"{name}4" if four_d else f"{name}3"
    for name, heads, dim in (("q", HEADS, rotary_dim), ("k", KV_HEADS, rotary_dim if k_rotary_dim is None else k_rotary_dim)):
        attrs = {"interleaved": interleaved, "rotary_embedding_dim": dim}
        if not four_d:
            attrs["num_heads"] = heads
        nodes.append(helper.make_node("RotaryEmbedding", [shapes[name], "cos", "sin", "position_ids"], [f"{name}_rot"],
                                      **attrs))
    inputs = ["q_rot", "k_rot", shapes["v"], "attention_mask" if mask else "",
              "past_key" if past else "", "past_value" if past else ""]
    outputs = ["y"] + (["present_key", "present_value"] if past else [])
    attrs = {"is_causal": causal}
    if not four_d:
        attrs.update(q_num_heads=HEADS, kv_num_heads=KV_HEADS)
    nodes.append(helper.make_node("Attention", inputs, outputs, name="attention", **attrs))
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, HIDDEN]),
                    helper.make_tensor_value_info("position_ids", TensorProto.INT64, [B, S])]
    if past:
        graph_inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, KV_HEADS, P, D])
                         for n in ("past_key", "past_value")]
    total = S + (P if past else 0)
    if mask == "bool":
        graph_inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, [B, 1, S, total]))
    elif mask == "float":
        graph_inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [B, HEADS, S, total]))
    elif mask == "narrow":
        graph_inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [B, 2, S, total]))
    graph_outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    graph = helper.make_graph(nodes, "g", graph_inputs, graph_outputs, init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _feeds(past: bool = True, mask: str = ""):
    feeds = {"x": RNG.standard_normal((B, S, HIDDEN)).astype(np.float32),
             "position_ids": np.tile(np.arange(P, P + S), (B, 1)).astype(np.int64)}
    if past:
        feeds.update({n: RNG.standard_normal((B, KV_HEADS, P, D)).astype(np.float32) for n in ("past_key", "past_value")})
    total = S + (P if past else 0)
    if mask == "bool":
        allowed = np.ones((B, 1, S, total), bool)
        allowed[1, ..., 0] = False  # a padded first key in the second row
        feeds["attention_mask"] = allowed
    elif mask == "float":
        feeds["attention_mask"] = (0.5 * RNG.standard_normal((B, HEADS, S, total))).astype(np.float32)
    return feeds


@pytest.mark.parametrize("four_d", [False, True], ids=["3d", "4d"])
@pytest.mark.parametrize("variant", ["half", "interleaved-partial", "no-past", "not-causal", "bool-mask",
                                     "float-mask-per-head"])
def test_standard_attention_becomes_fused_attention(four_d, variant, tmp_path):
    options = {"half": {}, "interleaved-partial": dict(interleaved=1, rotary_dim=4),
               "no-past": dict(past=False), "not-causal": dict(causal=0), "bool-mask": dict(mask="bool"),
               "float-mask-per-head": dict(mask="float", causal=0)}[variant]
    model = _model(four_d, **options)
    fused, (result,) = apply_pass(model, ConvertAttention())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1)
    assert counts["FusedAttention"] == 1 and "Attention" not in counts and "RotaryEmbedding" not in counts
    feeds = _feeds(past=options.get("past", True), mask=options.get("mask", False))
    assert_parity(model, fused, feeds, tmp_path, atol=2e-5)


@pytest.mark.parametrize("options, reason", [
    (dict(k_rotary_dim=4), "different tables"),
    (dict(mask="narrow"), "attn_mask"),
])
def test_refusals(options, reason):
    fused, (result,) = apply_pass(_model(False, **options), ConvertAttention())
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections


def test_softcap_and_float_masks_stay_standard():
    model = _model(False)
    attention = model.graph.node[-1]
    attention.attribute.append(helper.make_attribute("softcap", 30.0))
    _, (result,) = apply_pass(model, ConvertAttention())
    assert result.effect_times == 0 and any("softcap" in r for r in result.rejections)


def test_tables_computed_once_per_rotation_count_as_one(tmp_path):
    """onnxscript's opset-23 rotary fusion computes Cos(freqs) and Sin(freqs) again for each rotation, the
    tables read at each token already ([B, S, R/2], no position_ids)."""
    model = _model(False, past=False)
    half = D // 2
    model.graph.input.append(helper.make_tensor_value_info("freqs", TensorProto.FLOAT, [B, S, half]))
    for node in list(model.graph.node):
        if node.op_type == "RotaryEmbedding":
            side = node.output[0][0]
            model.graph.node.extend([helper.make_node("Cos", ["freqs"], [f"cos_{side}"]),
                                     helper.make_node("Sin", ["freqs"], [f"sin_{side}"])])
            del node.input[1:]
            node.input.extend([f"cos_{side}", f"sin_{side}"])
    nodes = sorted(model.graph.node, key=lambda n: n.op_type not in ("Cos", "Sin", "MatMul"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    fused, (result,) = apply_pass(model, ConvertAttention())
    assert result.effect_times == 1, result.rejections
    assert op_counts(fused)["FusedAttention"] == 1
    feeds = _feeds(past=False)
    feeds["freqs"] = RNG.uniform(0, 3, (B, S, half)).astype(np.float32)
    assert_parity(model, fused, feeds, tmp_path, atol=2e-5)
