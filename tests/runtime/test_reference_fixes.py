"""Standard ops replaced in the reference backend's evaluator (runtime/kernels/reference_fixes.py), against
onnxruntime on the same graph."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from runtime.kernels import reference_ops

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
