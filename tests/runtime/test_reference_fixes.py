"""Standard ops replaced in the reference backend's evaluator (cann_llm/runtime/kernels/reference_fixes.py), against
onnxruntime on the same graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from cann_llm.runtime.kernels import reference_ops

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("axis", [1, -2])
def test_gather_elements_along_an_axis_longer_than_64_equals_onnxruntime(axis):
    """A 256-row table read at 5 positions a row (Optimum's GPT-J reads its rotary table so), negative
    indices among them: onnx's own GatherElements takes at most 64 rows."""
    node = helper.make_node("GatherElements", ["data", "indices"], ["out"], axis=axis)
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 256, 8]),
                                                 helper.make_tensor_value_info("indices", TensorProto.INT64, [2, 5, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    feeds = {"data": rng.standard_normal((2, 256, 8)).astype(np.float32),
             "indices": rng.integers(-256, 256, (2, 5, 8), dtype=np.int64)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ReferenceEvaluator(model, new_ops=reference_ops()).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)


# (opset, x's type, its shape, scale's shape, attributes): onnxruntime's quantize_dynamic writes the first
# (opset 17, where onnx.reference has no DequantizeLinear); the others are the per-axis and blocked forms
DEQUANTIZE_CASES = [
    (17, TensorProto.UINT8, [6, 8], [], {}),
    (17, TensorProto.INT8, [6, 8], [8], {"axis": 1}),
    (13, TensorProto.UINT8, [4, 6, 8], [6], {"axis": -2}),
    (21, TensorProto.INT8, [64, 8], [2, 8], {"axis": 0, "block_size": 32}),
    (21, TensorProto.UINT8, [40, 3], [2, 3], {"axis": 0, "block_size": 32}),  # a last block cut short
]


@pytest.mark.parametrize("opset,kind,shape,scale_shape,attrs", DEQUANTIZE_CASES)
def test_dequantize_linear_equals_onnxruntime(opset, kind, shape, scale_shape, attrs):
    node = helper.make_node("DequantizeLinear", ["x", "scale", "zero_point"], ["y"], **attrs)
    graph = helper.make_graph([node], "dequantize", [helper.make_tensor_value_info("x", kind, shape),
                                                     helper.make_tensor_value_info("scale", TensorProto.FLOAT, scale_shape),
                                                     helper.make_tensor_value_info("zero_point", kind, scale_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    rng = np.random.default_rng(1)
    storage = helper.tensor_dtype_to_np_dtype(kind)
    low, high = np.iinfo(storage).min, np.iinfo(storage).max
    feeds = {"x": rng.integers(low, high + 1, shape).astype(storage),
             "scale": rng.uniform(0.01, 0.1, scale_shape).astype(np.float32),
             "zero_point": rng.integers(low, high + 1, scale_shape).astype(storage)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ReferenceEvaluator(model, new_ops=reference_ops()).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
