"""IntegerMatMulConversionPass on hand-built graphs in quantize_dynamic's spelling, against onnxruntime on the
graph it was given: which weights it takes, and the one activation input it leaves the matmuls of one
DynamicQuantizeLinear; then with WeightQuantizationPass, each form's weight storage repacked onto the 8-bit
kernel. Real quantizers' output: tests/test_onnxruntime_quantizers.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from fusion_utils import apply_pass, op_counts, run_original
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_integer_matmul import ConvertIntegerMatMul
from cann_llm.passes.quant.quantize_weights import QuantizeWeights

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


def _one_matmul(form: str, storage, zero_point: int | None, per_column: bool):
    """x [5, K] → one dynamically quantized matmul in `form`, its weight of `storage` with `zero_point` (None:
    no zero point input) for the tensor or each column."""
    shape = (N,) if per_column else ()
    info = np.iinfo(storage)
    init = [numpy_helper.from_array(RNG.integers(info.min, info.max + 1, (K, N)).astype(storage), "w"),
            numpy_helper.from_array(RNG.uniform(0.01, 0.02, shape).astype(np.float32), "ws")]
    if zero_point is not None:
        init.append(numpy_helper.from_array(np.full(shape, zero_point, storage), "wz"))
    wz = "" if zero_point is None else "wz"
    quantize = helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])
    if form == "MatMulInteger":
        nodes = [quantize, helper.make_node("MatMulInteger", ["xq", "w", "xz", wz], ["i"]),
                 helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["xs", "ws"], ["s"]), helper.make_node("Mul", ["f", "s"], ["y"])]
    elif form == "MatMulIntegerToFloat":
        nodes = [quantize, helper.make_node("MatMulIntegerToFloat", ["xq", "w", "xs", "ws", "xz", wz], ["y"],
                                            domain="com.microsoft")]
    else:
        nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "w", "ws", wz], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, N])], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("form,storage,zero_point,per_column", [
    ("MatMulInteger", np.int8, None, False),  # quantize_dynamic's default: symmetric int8
    ("MatMulInteger", np.int8, 5, False),  # WeightSymmetric=False: signed storage, nonzero zero points
    ("MatMulInteger", np.int8, -7, True),
    ("MatMulIntegerToFloat", np.int8, 5, True),
    ("MatMulInteger", np.uint8, 131, True),  # QUInt8
    ("MatMulInteger", np.uint8, 0, True),  # unsigned storage, zero points all 0
    ("DynamicQuantizeMatMul", np.uint8, None, False),  # unsigned storage, no zero point input
    ("MatMulIntegerToFloat", np.uint8, None, True),
])
def test_each_weight_storage_repacks_onto_the_eight_bit_kernel(form, storage, zero_point, per_column):
    model = _one_matmul(form, storage, zero_point, per_column)
    x = RNG.standard_normal((5, K)).astype(np.float32)
    packed, _ = apply_pass(model, ConvertIntegerMatMul(), QuantizeWeights(None))
    assert op_counts(packed)["MatMulInt4"] == 1
    want = run_original(model, {"x": x})[0]
    # both quantize the activations (onnxruntime per tensor, the kernel per block): a wrong zero point or
    # storage convention is off by the weights' whole range
    assert np.abs(run_original(packed, {"x": x})[0] - want).max() <= 0.03 * np.abs(want).max()
