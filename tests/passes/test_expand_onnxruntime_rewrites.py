"""OnnxRuntimeRewriteExpansionPass (cann_llm/passes/expand_onnxruntime_rewrites.py) alone: each spelling onnxruntime's
extended optimizations write is rewritten into standard ops that compute what onnxruntime computes on the
original (both graphs run), and none of the contrib ops is left."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.expand_onnxruntime_rewrites import ExpandOnnxRuntimeRewrites
from cann_llm.passes.infer_shapes import InferShapes

pytestmark = pytest.mark.unit
RNG = np.random.default_rng(0)
MS = helper.make_opsetid("com.microsoft", 1)


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _same_after(model: onnx.ModelProto, feeds, atol: float = 1e-5) -> onnx.ModelProto:
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    result = ExpandOnnxRuntimeRewrites().run(graph)
    rewritten = gs.export_onnx(graph)
    assert result.effect_times == result.match_times > 0, result.rejections
    assert not any(n.domain == "com.microsoft" or n.op_type == "Split" for n in rewritten.graph.node)
    for got, want in zip(_run(rewritten, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=atol, rtol=0)
    return rewritten


@pytest.mark.parametrize("a_shape, b_shape, attrs", [
    ((2, 3, 6, 8), (2, 3, 7, 8), dict(transB=1, alpha=0.35355)),  # the scores' MatMul with the scale folded
    ((4, 3), (5, 4), dict(transA=1, transB=1, alpha=0.125)),
    ((2, 6, 8), (8, 7), dict()),
])
def test_fused_matmul_becomes_matmul_of_the_transposed_operands_times_alpha(a_shape, b_shape, attrs):
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in (("a", a_shape), ("b", b_shape))]
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", **attrs)
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([node], "g", inputs, [output]), opset_imports=[helper.make_opsetid("", 17), MS])
    _same_after(model, {"a": RNG.standard_normal(a_shape).astype(np.float32),
                        "b": RNG.standard_normal(b_shape).astype(np.float32)})


def test_float16_without_types_in_the_file_keeps_alpha_in_float16():
    """onnxruntime saves its optimized graphs without the types of their values: alpha takes the operands'."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [2, 6, 8]) for n in ("a", "b")]
    nodes = [helper.make_node("FusedMatMul", ["a", "b"], ["s"], domain="com.microsoft", transB=1, alpha=0.125),
             helper.make_node("QuickGelu", ["s"], ["y"], domain="com.microsoft")]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT16,
                                                                                                   None)]),
                              opset_imports=[helper.make_opsetid("", 17), MS])
    _same_after(model, {n: RNG.standard_normal((2, 6, 8)).astype(np.float16) for n in ("a", "b")}, atol=2e-3)


@pytest.mark.parametrize("alpha", [None, 1.0, 0.5])
def test_quick_gelu_becomes_x_times_sigmoid_of_alpha_x(alpha):
    node = helper.make_node("QuickGelu", ["x"], ["y"], domain="com.microsoft", **({"alpha": alpha} if alpha else {}))
    model = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
                              opset_imports=[helper.make_opsetid("", 17), MS])
    _same_after(model, {"x": (4 * RNG.standard_normal((2, 5))).astype(np.float32)})


@pytest.mark.parametrize("sizes", [[4, 4], [3, 5]])
def test_rotate_halfs_split_becomes_two_slices(sizes):
    nodes = [helper.make_node("Split", ["x", "sizes"], ["first", "second"], axis=-1),
             helper.make_node("Neg", ["second"], ["negated"]),
             helper.make_node("Concat", ["negated", "first"], ["y"], axis=-1)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.array(sizes), "sizes")]),
        opset_imports=[helper.make_opsetid("", 17)])
    _same_after(model, {"x": RNG.standard_normal((1, 2, 3, 8)).astype(np.float32)})


def test_copies_of_one_dequantization_become_one():
    """A quantized table's lookup dequantized once for each reader (onnxruntime's QDQ optimizations), as a
    norm's Pow and Div read it: one DequantizeLinear, read by both."""
    table = numpy_helper.from_array(RNG.integers(0, 256, (16, 8), dtype=np.uint8), "table")
    scale = numpy_helper.from_array(np.array(0.02, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(120, np.uint8), "zero")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("DequantizeLinear", ["rows", "scale", "zero"], ["a"]),
             helper.make_node("DequantizeLinear", ["rows", "scale", "zero"], ["b"]),
             helper.make_node("Pow", ["a", "two"], ["squared"]),
             helper.make_node("Div", ["b", "squared"], ["y"])]
    graph = helper.make_graph(nodes, "copies", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
                              [table, scale, zero, numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = _same_after(model, {"ids": np.array([0, 5, 15], np.int64)})
    dequantize = [n for n in rewritten.graph.node if n.op_type == "DequantizeLinear"]
    readers = {n.op_type: n.input[0] for n in rewritten.graph.node if n.op_type in ("Pow", "Div")}
    assert len(dequantize) == 1 and readers == {"Pow": dequantize[0].output[0], "Div": dequantize[0].output[0]}


def test_copies_of_a_weights_dequantization_stay_apart():
    """Layers sharing one quantized weight, each given its own DequantizeLinear: merged, the weight would have
    two readers, which the projection fusions refuse to merge."""
    weight = numpy_helper.from_array(RNG.integers(-127, 128, (8, 8), dtype=np.int8), "weight")
    scale = numpy_helper.from_array(np.array(0.02, np.float32), "scale")
    nodes = [helper.make_node("DequantizeLinear", ["weight", "scale"], ["w0"]),
             helper.make_node("DequantizeLinear", ["weight", "scale"], ["w1"]),
             helper.make_node("MatMul", ["x", "w0"], ["h"]),
             helper.make_node("MatMul", ["h", "w1"], ["y"])]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])], [weight, scale])
    graph = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = ExpandOnnxRuntimeRewrites().run(graph)
    assert result.effect_times == 0 and sum(n.op == "DequantizeLinear" for n in graph.nodes) == 2
