"""GemmCanonicalizationPass: alone, each Gemm spelling of a linear layer becomes MatMul (+ Add) with the same
numbers out (onnxruntime on both graphs) and the forms it must leave alone stay Gemms; in a compile, GPT-2's
Conv1D layers (Gemms in both exporters' graphs) are quantized like any linear layer."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import compile_to, ort_reference
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.canonicalize_gemm import CanonicalizeGemm
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.ort_session import session_options

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 8)).astype(np.float32)
W_KN = RNG.standard_normal((8, 5)).astype(np.float32)  # [K, N]: GPT-2's Conv1D, transB=0
BIAS = RNG.standard_normal(5).astype(np.float32)


def _model(nodes, initializers, inputs=("x",)) -> onnx.ModelProto:
    shapes = {"x": [3, 8], "c": [5], "a_t": [8, 3]}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in inputs],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _canonical(model: onnx.ModelProto):
    graph = gs.import_onnx(model)
    result = CanonicalizeGemm().run(graph)
    return gs.export_onnx(graph), result


@pytest.mark.unit
def test_every_weight_gemm_becomes_a_matmul_with_the_same_outputs():
    initializers = {"w_kn": W_KN, "w_nk": np.ascontiguousarray(W_KN.T), "b": BIAS, "b2d": BIAS[None, :],
                    "solo": np.ascontiguousarray(W_KN.T), "w_nk_kn": W_KN}
    nodes = [
        helper.make_node("Gemm", ["x", "solo"], ["alone"], transB=1),                      # its only reader
        helper.make_node("MatMul", ["x", "w_nk_kn"], ["taken"]),                           # a name in use
        helper.make_node("Gemm", ["x", "w_kn", "b"], ["conv1d"]),                          # TorchScript's GPT-2
        helper.make_node("Gemm", ["x", "w_nk"], ["linear"], transB=1),                     # dynamo's 2-D Linear
        helper.make_node("Gemm", ["x", "w_nk", "b2d"], ["scaled"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Gemm", ["x", "w_nk", "c"], ["computed_bias"], transB=1),         # C an input
        helper.make_node("Gemm", ["x", "w_nk"], ["shared"], transB=1, alpha=0.5),          # B read again
    ]
    model = _model(nodes, initializers, inputs=("x", "c"))
    feeds = {"x": X, "c": RNG.standard_normal(5).astype(np.float32)}
    canonical, result = _canonical(model)
    assert (result.match_times, result.effect_times) == (6, 6)
    ops = Counter(node.op_type for node in canonical.graph.node)
    assert ops == {"MatMul": 7, "Add": 3}
    # w_nk transposed once for the two Gemms that read it unscaled (under a name of its own: w_nk_kn is
    # taken), once for the two scaled by 0.5; a weight only its Gemm read keeps its name
    assert sorted(t.name for t in canonical.graph.initializer) == [
        "b", "b2d_beta", "solo", "w_kn", "w_nk_kn", "w_nk_kn_1", "w_nk_kn_x0.5"]
    for got, expected in zip(_run(canonical, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.unit
def test_a_transposed_a_a_computed_b_and_a_scaled_computed_c_stay_gemms():
    nodes = [helper.make_node("Gemm", ["a_t", "w_kn"], ["ta"], transA=1),
             helper.make_node("Gemm", ["x", "a_t"], ["computed_b"]),
             helper.make_node("Gemm", ["x", "w_kn", "c"], ["scaled_c"], beta=0.5)]
    model = _model(nodes, {"w_kn": W_KN}, inputs=("x", "a_t", "c"))
    canonical, result = _canonical(model)
    assert result.effect_times == 0
    assert [node.op_type for node in canonical.graph.node] == ["Gemm"] * 3
    assert sorted(reason.split(": ", 1)[1] for reason in result.rejections) == [
        "A is transposed", "B is computed, not a weight", "C is computed and scaled by beta"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["ts", "dynamo"])
def test_gpt2s_conv1d_layers_are_quantized_and_follow_the_float_model(dynamo, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("gpt2", dynamo=dynamo, with_past=False)
    loaded = load_artifact(compile_to(source, tmp_path / "m", enable_compress_weight=True))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    # c_attn, attn.c_proj, c_fc and mlp.c_proj of both layers; the head (tied to the embedding) stays float
    assert counts["MatMulInt4"] == 8 and counts["Gemm"] == 0 and counts["MatMul"] == 1
    rng = np.random.default_rng(1)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"],
                             rng.integers(0, 256, (1, 6), dtype=np.int64), 0, rng)
    expected = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        logits = Executor(loaded, backend).run(feeds)["logits"]
        # 4-bit weights move the logits, but they still follow the float model's
        assert np.corrcoef(logits.reshape(-1), expected.reshape(-1))[0, 1] > 0.95


@pytest.mark.unit
@pytest.mark.parametrize("target, bias, reads_tokens", [([2, 3, 1, 5], BIAS, True), ([0, 5], BIAS, False),
                                                        ([2, 3, 1, 5], np.tile(BIAS, (6, 1)), False)])
def test_onnxsims_flattened_biased_layer_multiplies_the_tokens_themselves(target, bias, reads_tokens):
    """onnxsim writes a biased linear layer on [B, S, K] tokens as Reshape([-1, K]) → Gemm → Reshape (the
    head split): the MatMul reads the tokens, so the projection stays [B, S, N] for the attention fusion; a
    Reshape target copying an input dim (0) would change meaning, and a bias of rows ([B·S, N]) needs the
    rows: both keep them."""
    tokens = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    initializers = {"flat": np.array([-1, 8], np.int64), "w": W_KN, "b": bias, "heads": np.array(target, np.int64)}
    nodes = [helper.make_node("Reshape", ["tokens", "flat"], ["x2d"]), helper.make_node("Gemm", ["x2d", "w", "b"], ["y2d"]),
             helper.make_node("Reshape", ["y2d", "heads"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [2, 3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    imported = gs.import_onnx(model)
    InferShapes().run(imported)
    CanonicalizeGemm().run(imported)
    matmul = next(n for n in imported.nodes if n.op == "MatMul")
    assert (matmul.inputs[0].name == "tokens") == reads_tokens
    after = gs.export_onnx(imported)
    np.testing.assert_allclose(_run(after, {"tokens": tokens})[0], _run(model, {"tokens": tokens})[0], atol=1e-5)
