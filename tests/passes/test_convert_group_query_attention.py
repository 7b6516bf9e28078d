"""GroupQueryAttentionConversionPass on hand-built graphs (GroupQueryAttention with the length inputs the
genai builder and onnxscript derive), against onnxruntime's own GroupQueryAttention kernel."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts, run_fused, run_original
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_group_query_attention import ConvertGroupQueryAttention

pytestmark = pytest.mark.unit

B, S, P, HIDDEN, HEADS, KV_HEADS = 2, 5, 3, 32, 4, 2
RNG = np.random.default_rng(11)


def _model(head_dim: int = 16, packed: bool = True, past: bool = True, rotary: bool = True, interleaved: int = 0,
           rotary_width: int | None = None, lengths: str = "mask", explicit_positions: bool = False, **attrs):
    """x → q/k/v projections → GroupQueryAttention(seqlens_k, total from `lengths`) → y (+ present)."""
    widths = {"q": HEADS * head_dim, "k": KV_HEADS * head_dim, "v": KV_HEADS * head_dim}
    half = rotary_width or head_dim // 2
    angles = np.arange(64)[:, None] * (0.1 + np.arange(half))[None, :] * 0.05
    init = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
            numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array(1, np.int64), "one_scalar"),
            numpy_helper.from_array(np.array(1, np.int32), "one_int32")]
    if packed:
        packed_weight = (0.3 * RNG.standard_normal((HIDDEN, sum(widths.values())))).astype(np.float32)
        init.append(numpy_helper.from_array(packed_weight, "wqkv"))
        nodes = [helper.make_node("MatMul", ["x", "wqkv"], ["qkv"])]
        qkv = ["qkv", "", ""]
    else:
        init += [numpy_helper.from_array((0.3 * RNG.standard_normal((HIDDEN, n))).astype(np.float32), f"w{name}")
                 for name, n in widths.items()]
        nodes = [helper.make_node("MatMul", ["x", f"w{name}"], [name]) for name in widths]
        qkv = ["q", "k", "v"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", HIDDEN])]
    if lengths in ("mask", "mask-longest"):
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]))
        nodes += [helper.make_node("ReduceSum", ["attention_mask", "one"], ["summed"], keepdims=0),
                  helper.make_node("Sub", ["summed", "one"], ["last"]),
                  helper.make_node("Cast", ["last"], ["seqlens_k"], to=TensorProto.INT32)]
        if lengths == "mask":
            nodes += [helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
                      helper.make_node("Gather", ["mask_shape", "one_scalar"], ["width"], axis=0),
                      helper.make_node("Cast", ["width"], ["total"], to=TensorProto.INT32)]
        else:  # the longest sequence, not the mask's width
            nodes += [helper.make_node("ReduceMax", ["seqlens_k", "zero"], ["longest"], keepdims=0),
                      helper.make_node("Add", ["longest", "one_int32"], ["total"])]
    elif lengths == "positions":
        nodes += [helper.make_node("ReduceMax", ["position_ids", "one"], ["newest"], keepdims=0),
                  helper.make_node("Cast", ["newest"], ["seqlens_k"], to=TensorProto.INT32),
                  helper.make_node("ReduceMax", ["seqlens_k", "zero"], ["longest"], keepdims=0),
                  helper.make_node("Add", ["longest", "one_int32"], ["total"])]
    else:  # lengths given as graph inputs: nothing to read them from
        inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
                   helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    if lengths == "positions" or explicit_positions:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]))
    if past:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", KV_HEADS, "p", head_dim])
                   for n in ("past_key", "past_value")]
    gqa_inputs = qkv + (["past_key", "past_value"] if past else ["", ""]) + ["seqlens_k", "total"]
    gqa_inputs += ["cos_cache", "sin_cache"] if rotary else ["", ""]
    if explicit_positions:
        gqa_inputs.append("position_ids")
    outputs = ["y", "present_key", "present_value"]
    nodes.append(helper.make_node("GroupQueryAttention", gqa_inputs, outputs, name="gqa", domain="com.microsoft",
                                  num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=int(rotary),
                                  rotary_interleaved=interleaved, **attrs))
    graph_outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    graph = helper.make_graph(nodes, "g", inputs, graph_outputs, init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _feeds(head_dim: int = 16, past: int | None = P, seq: int = S, batch: int = B, lengths: str = "mask",
           explicit_positions: bool = False, mask=None):
    """Inputs for `seq` new tokens after `past` cached ones (None: a model without cache inputs). A prompt
    after a non-empty cache takes one sequence: onnxruntime's kernel refuses a batch of them."""
    feeds = {"x": RNG.standard_normal((batch, seq, HIDDEN)).astype(np.float32)}
    if past is not None:
        feeds.update({n: RNG.standard_normal((batch, KV_HEADS, past, head_dim)).astype(np.float32)
                      for n in ("past_key", "past_value")})
    cached = past or 0
    if lengths == "mask":
        feeds["attention_mask"] = np.ones((batch, cached + seq), np.int64) if mask is None else mask
    if lengths == "positions" or explicit_positions:
        feeds["position_ids"] = np.tile(np.arange(cached, cached + seq), (batch, 1)).astype(np.int64)
    return feeds


VARIANTS = {
    "packed-rotary-decode": ({}, dict(seq=1)),
    "packed-rotary-chunk": ({}, dict(batch=1)),
    "separate-interleaved-partial": (dict(packed=False, head_dim=32, interleaved=1, rotary_width=8),
                                     dict(head_dim=32, seq=1)),
    "prompt": (dict(past=False), dict(past=None)),
    "prompt-after-empty-cache": ({}, dict(past=0)),
    "no-rotary": (dict(rotary=False), dict(seq=1)),
    "onnxscript-lengths": (dict(lengths="positions"), dict(lengths="positions", batch=1)),
    "onnxscript-lengths-decode": (dict(lengths="positions"), dict(lengths="positions", seq=1)),
    "explicit-positions": (dict(explicit_positions=True), dict(explicit_positions=True, seq=1)),
    # Gemma 2 as the genai builder writes it: the scores capped by c·tanh(s / c)
    "softcap-decode": (dict(softcap=1.5), dict(seq=1)),
    "softcap-chunk": (dict(softcap=1.5), dict(batch=1)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_group_query_attention_becomes_fused_attention(variant, tmp_path):
    options, feed_options = VARIANTS[variant]
    model = _model(**options)
    fused, (result,) = apply_pass(model, ConvertGroupQueryAttention())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1), result.rejections
    assert counts["FusedAttention"] == 1 and "GroupQueryAttention" not in counts
    assert_parity(model, fused, _feeds(**feed_options), tmp_path, atol=2e-5)


def test_right_padded_batch_matches_on_every_real_token(tmp_path):
    """A prompt batch padded on the right (output rows of real tokens and the whole cache are equal; a
    padding row's output is implementation-defined), then a decode step after a padded cache (output)."""
    model = _model(past=False)
    fused, _ = apply_pass(model, ConvertGroupQueryAttention())
    mask = np.ones((B, S), np.int64)
    mask[1, 3:] = 0  # the second prompt has 3 tokens
    feeds = _feeds(past=None, mask=mask)
    expected = run_original(model, feeds)
    for backend in ("onnxruntime", "reference"):
        got = run_fused(fused, feeds, backend, tmp_path)
        np.testing.assert_allclose(got[0][0], expected[0][0], atol=2e-5, rtol=0)
        np.testing.assert_allclose(got[0][1, :3], expected[0][1, :3], atol=2e-5, rtol=0)
        for a, b in zip(got[1:], expected[1:]):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    model = _model()
    fused, _ = apply_pass(model, ConvertGroupQueryAttention())
    mask = np.ones((B, P + 1), np.int64)
    mask[1, P - 2:P] = 0  # the second sequence's cache holds P - 2 tokens, then padding
    feeds = _feeds(seq=1, mask=mask)
    expected = run_original(model, feeds)
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(run_fused(fused, feeds, backend, tmp_path)[0], expected[0], atol=2e-5, rtol=0)


def test_paged_compile_reads_positions_from_the_runtime():
    fused, (result,) = apply_pass(_model(), ConvertGroupQueryAttention(paged=True))
    assert result.effect_times == 1
    assert "position_ids" in [i.name for i in fused.graph.input]
    gathers = [n for n in fused.graph.node if n.op_type == "Gather" and "cos_cache" in n.input]
    assert [n.input[1] for n in gathers] == ["position_ids"]


@pytest.mark.parametrize("options, reason", [
    (dict(local_window_size=2), "local_window_size"),
    (dict(smooth_softmax=1), "smooth softmax"),
    (dict(lengths="inputs"), "seqlens_k is derived neither"),
    (dict(lengths="mask-longest"), "not the attention mask's width"),
    (dict(causal=0), "causal=0"),
    (dict(qk_output=1), "the qk output"),
])
def test_refusals(options, reason):
    _, (result,) = apply_pass(_model(**options), ConvertGroupQueryAttention())
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections


def test_attention_bias_is_refused():
    model = _model()
    model.graph.input.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["b", 1, "s", "t"]))
    gqa = model.graph.node[-1]
    gqa.input.extend(["", "bias"])
    _, (result,) = apply_pass(model, ConvertGroupQueryAttention())
    assert result.effect_times == 0 and any("attention bias" in r for r in result.rejections), result.rejections


def test_shape_inference_of_a_contrib_graph_writes_nothing(tmp_path, monkeypatch):
    """onnxruntime's symbolic inference leaves GroupQueryAttention's outputs incomplete; its own entry
    point would then save the model into the working directory. ShapeInferencePass writes nothing."""
    import onnx_graphsurgeon as gs

    from cann_llm.passes.infer_shapes import InferShapes

    monkeypatch.chdir(tmp_path)
    graph = gs.import_onnx(_model())
    assert InferShapes().run(graph).match_times > 0
    assert list(tmp_path.iterdir()) == []
