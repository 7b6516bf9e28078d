"""compute_in_float32 (cann_llm/passes/upcast_float_compute.py) alone: a graph computing in bfloat16 or float16 computes
what numpy computes in float32 on the same weights (onnxruntime runs the rewritten graph; it cannot run the
bfloat16 original), and a graph that only stores weights in a low precision is left as it is."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from cann_llm.passes.upcast_float_compute import Raised, compute_in_float32, low_precision_compute

pytestmark = pytest.mark.unit
RNG = np.random.default_rng(0)
LOW = {"bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16), "float16": (TensorProto.FLOAT16, np.float16)}


def _tensor(name: str, values: np.ndarray, low: str) -> onnx.TensorProto:
    enum, dtype = LOW[low]
    stored = np.asarray(values, np.float32).astype(dtype)
    return helper.make_tensor(name, enum, stored.shape, stored.view(np.uint16).tobytes(), raw=True)


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_graph_computing_in_a_low_precision_computes_in_float32(low):
    """x (float32) cast down, times a low-precision weight, a low-precision constant added (ConstantOfShape's
    value), cast back up: after the rewrite nothing is rounded to the low precision on the way (x's values
    are not representable in it)."""
    enum, dtype = LOW[low]
    weight = RNG.standard_normal((4, 3)).astype(np.float32).astype(dtype).astype(np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["xl"], to=enum),
             helper.make_node("MatMul", ["xl", "w"], ["h"]),
             helper.make_node("Shape", ["h"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["c"], value=_tensor("fill", [0.1], low)),
             helper.make_node("Add", ["h", "c"], ["hc"]),
             helper.make_node("Cast", ["hc"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [_tensor("w", weight, low)],
                              value_info=[helper.make_tensor_value_info("h", enum, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    imported = gs.import_onnx(model)
    assert compute_in_float32(imported) == Raised(low, low)
    rewritten = gs.export_onnx(imported)
    types = {t.data_type for t in rewritten.graph.initializer}
    types |= {v.type.tensor_type.elem_type for v in rewritten.graph.value_info}
    types |= {a.i for n in rewritten.graph.node for a in n.attribute if a.name == "to"}
    assert not types & {TensorProto.BFLOAT16, TensorProto.FLOAT16}
    x = (1 + RNG.standard_normal((2, 4)) / 1000).astype(np.float32)  # 1.000x: no low-precision neighbour
    fill_value = np.float32(np.array([0.1], np.float32).astype(dtype)[0])  # the stored constant, as stored
    np.testing.assert_allclose(_run(rewritten, {"x": x})[0], x @ weight + fill_value, rtol=1e-6, atol=1e-6)


def test_float16_graph_inputs_and_outputs_become_float32():
    """A model exported in float16 end to end (its past and logits float16): its graph's inputs and outputs
    are float32 afterwards (the artifact's signature), its Relu computing on them."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    imported = gs.import_onnx(model)
    assert compute_in_float32(imported) == Raised("float16", None)  # no weights
    assert [t.dtype for t in (*imported.inputs, *imported.outputs)] == [np.float32, np.float32]
    feeds = {"x": RNG.standard_normal((2, 4)).astype(np.float32)}
    np.testing.assert_array_equal(_run(gs.export_onnx(imported), feeds)[0], np.maximum(feeds["x"], 0))


def test_weights_only_stored_low_and_cast_up_before_use_are_left_as_they_are():
    """bfloat16 storage read through a Cast to float32 already computes in float32: nothing to raise."""
    weight = RNG.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [_tensor("w", weight, "bfloat16")])
    imported = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert low_precision_compute(imported) is None
    assert compute_in_float32(imported) is None
    assert gs.export_onnx(imported).graph.initializer[0].data_type == TensorProto.BFLOAT16


def test_float32_weights_beside_a_bfloat16_term_keep_float32_as_their_dtype():
    """Falcon-RW under transformers 5: float32 weights, one term computed in bfloat16. The arithmetic is raised,
    and the weights' own dtype (what must_keep_origin_dtype stores them in) stays float32."""
    weight = RNG.standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Cast", ["h"], ["hl"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["hl"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [64, 64], weight.tobytes(), raw=True)])
    imported = gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert compute_in_float32(imported) == Raised("bfloat16", None)
