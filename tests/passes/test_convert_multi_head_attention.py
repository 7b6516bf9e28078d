"""MultiHeadAttentionConversionPass on hand-built graphs (com.microsoft RotaryEmbedding on q and k, then
MultiHeadAttention), against onnxruntime's own contrib kernels."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_multi_head_attention import ConvertMultiHeadAttention

pytestmark = pytest.mark.unit

B, S, P, HIDDEN, HEADS, D = 2, 4, 3, 32, 2, 16
RNG = np.random.default_rng(5)


def _model(rotary: bool = True, offset: bool = False, interleaved: int = 0, rotary_dim: int = 0, past: bool = True,
           mask: bool = False, bias: bool = False, unidirectional: int = 1, key_rotary_dim: int | None = None,
           key_interleaved: int | None = None, rotate_key: bool = True, mask_shape=("b", "t")):
    """x → q/k/v MatMuls → RotaryEmbedding(q), RotaryEmbedding(k) → MultiHeadAttention → y (+ present)."""
    half = (rotary_dim or D) // 2
    angles = np.arange(64)[:, None] * (0.1 + np.arange(half))[None, :] * 0.05
    init = [numpy_helper.from_array((0.3 * RNG.standard_normal((HIDDEN, HIDDEN))).astype(np.float32), f"w{n}")
            for n in "qkv"]
    init += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [n]) for n in "qkv"]
    q, k = "q", "k"
    if rotary:
        key_dim = rotary_dim if key_rotary_dim is None else key_rotary_dim
        key_pairs = interleaved if key_interleaved is None else key_interleaved
        for name, dim, pairs in (("q", rotary_dim, interleaved), ("k", key_dim, key_pairs))[:2 if rotate_key else 1]:
            nodes.append(helper.make_node("RotaryEmbedding", [name, "position_ids", "cos_cache", "sin_cache"],
                                          [f"{name}_rot"], domain="com.microsoft", interleaved=pairs,
                                          rotary_embedding_dim=dim, num_heads=HEADS if dim else 0))
        q, k = "q_rot", "k_rot" if rotate_key else "k"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", HIDDEN]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1] if offset else ["b", "s"])]
    if mask:
        inputs.append(helper.make_tensor_value_info("key_padding_mask", TensorProto.INT32, list(mask_shape)))
    if bias:
        inputs.append(helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, ["b", HEADS, "s", "t"]))
    if past:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", HEADS, "p", D]) for n in ("past_key", "past_value")]
    mha_inputs = [q, k, "v", "", "key_padding_mask" if mask else "", "attention_bias" if bias else "",
                  "past_key" if past else "", "past_value" if past else ""]
    outputs = ["y"] + (["present_key", "present_value"] if past else [])
    nodes.append(helper.make_node("MultiHeadAttention", mha_inputs, outputs, name="mha", domain="com.microsoft",
                                  num_heads=HEADS, unidirectional=unidirectional))
    graph_outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    graph = helper.make_graph(nodes, "g", inputs, graph_outputs, init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _feeds(offset: bool = False, past: bool = True, mask: bool = False, bias: bool = False, **_):
    cached = P if past else 0
    feeds = {"x": RNG.standard_normal((B, S, HIDDEN)).astype(np.float32),
             "position_ids": np.array([cached], np.int64) if offset
             else np.tile(np.arange(cached, cached + S), (B, 1)).astype(np.int64)}
    if past:
        feeds.update({n: RNG.standard_normal((B, HEADS, P, D)).astype(np.float32) for n in ("past_key", "past_value")})
    if mask:
        feeds["key_padding_mask"] = np.ones((B, cached + S), np.int32)
        feeds["key_padding_mask"][1, 0] = 0  # the second sequence's first key is padding
    if bias:
        feeds["attention_bias"] = (0.5 * RNG.standard_normal((B, HEADS, S, cached + S))).astype(np.float32)
    return feeds


VARIANTS = {
    "rotary-causal": {},
    "offset-positions": dict(offset=True),
    "interleaved-partial": dict(interleaved=1, rotary_dim=8),
    "no-past": dict(past=False),
    "padding-mask": dict(mask=True),
    "bias-not-causal": dict(rotary=False, bias=True, unidirectional=0),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_multi_head_attention_becomes_fused_attention(variant, tmp_path):
    options = VARIANTS[variant]
    model = _model(**options)
    fused, (result,) = apply_pass(model, ConvertMultiHeadAttention())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1), result.rejections
    assert counts["FusedAttention"] == 1 and "MultiHeadAttention" not in counts and "RotaryEmbedding" not in counts
    assert_parity(model, fused, _feeds(**options), tmp_path, atol=2e-5)


def test_offset_positions_at_opset_14_run_after_the_conversion(tmp_path):
    """The positions counted from an offset read the token count with Gather, not Shape's start and end
    (opset 15): an opset-14 graph converts into one onnxruntime runs."""
    model = _model(offset=True)
    model.opset_import[0].version = 14
    fused, (result,) = apply_pass(model, ConvertMultiHeadAttention())
    assert result.effect_times == 1
    assert_parity(model, fused, _feeds(offset=True), tmp_path, atol=2e-5)


@pytest.mark.parametrize("options, reason", [
    (dict(key_interleaved=1), "different tables"),
    (dict(key_rotary_dim=8), "rotary caches are not"),
    (dict(rotate_key=False), "only one of q and k"),
    (dict(mask=True, mask_shape=("b",)), "key_padding_mask is not"),
])
def test_refusals(options, reason):
    _, (result,) = apply_pass(_model(**options), ConvertMultiHeadAttention())
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections


def test_packed_bias_is_refused():
    model = _model()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3 * HIDDEN, np.float32), "qkv_bias"))
    model.graph.node[-1].input[3] = "qkv_bias"
    _, (result,) = apply_pass(model, ConvertMultiHeadAttention())
    assert result.effect_times == 0 and any("packed q/k/v bias" in r for r in result.rejections), result.rejections
