"""IntegerMatMulConversionPass on hand-built graphs in quantize_dynamic's spelling, against onnxruntime on the
graph it was given: which weights it takes, and the one activation input it leaves the matmuls of one
DynamicQuantizeLinear. Real quantizers' output: tests/test_dynamic_quantization.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fusion_utils import apply_pass, op_counts
from onnx import TensorProto, helper, numpy_helper

from passes.convert_integer_matmul import ConvertIntegerMatMul

pytestmark = pytest.mark.unit

K, N = 16, 8
RNG = np.random.default_rng(5)


def _model(scale_shape: tuple[int, ...], projections: int = 2):
    """x [3, K] → DynamicQuantizeLinear → `projections` × Mul(Cast(MatMulInteger(·, W int8)), x_scale · w_scale)."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    init, outputs = [], []
    for p in range(projections):
        init += [numpy_helper.from_array(RNG.integers(-127, 128, (K, N), dtype=np.int8), f"w{p}"),
                 numpy_helper.from_array(RNG.uniform(0.01, 0.1, scale_shape).astype(np.float32), f"ws{p}"),
                 numpy_helper.from_array(np.zeros(scale_shape, np.int8), f"wz{p}")]
        nodes += [helper.make_node("MatMulInteger", ["xq", f"w{p}", "xz", f"wz{p}"], [f"i{p}"]),
                  helper.make_node("Cast", [f"i{p}"], [f"f{p}"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["xs", f"ws{p}"], [f"s{p}"]),
                  helper.make_node("Mul", [f"f{p}", f"s{p}"], [f"y{p}"])]
        outputs.append(helper.make_tensor_value_info(f"y{p}", TensorProto.FLOAT, [3, N]))
    graph = helper.make_graph(nodes, "dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
                              outputs, init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("scale_shape", [(), (N,)], ids=["per-tensor", "per-column"])
def test_the_matmuls_of_one_quantized_activation_read_one_input(scale_shape):
    model = _model(scale_shape)
    converted, (result,) = apply_pass(model, ConvertIntegerMatMul())
    assert (result.match_times, result.effect_times) == (2, 2)
    counts = op_counts(converted)
    assert [counts[op] for op in ("MatMul", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger")] == [2, 3, 1, 0]
    matmuls = [node for node in converted.graph.node if node.op_type == "MatMul"]
    assert matmuls[0].input[0] == matmuls[1].input[0]
    x = RNG.standard_normal((3, K)).astype(np.float32)
    for got, want in zip(_run(converted, x), _run(model, x)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_a_scale_for_each_row_is_refused_and_left_as_it_is():
    model = _model((K, 1), projections=1)
    converted, (result,) = apply_pass(model, ConvertIntegerMatMul())
    assert result.effect_times == 0
    assert result.rejections[0].endswith(f"a weight's scale or zero point has {K} values, neither one nor one a column ({N})")
    assert op_counts(converted)["MatMulInteger"] == 1
