"""light_model: a real export as ONNX without its weights' bytes, for the tools that serialise a model (shape
inference, the version converter). It must describe the same graph: every large constant an input of the same
dtype and shape, the small ones still initializers, shapes inferred as on the full model, and the graph left
as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from cann_llm.compiler.loader import import_graph
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx

from cann_llm.passes.graph_utils import LIGHT_WEIGHT_LIMIT, light_model


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_large_constants_become_typed_inputs_and_shapes_infer_as_on_the_full_model(dynamo):
    from cann_llm.models.tiny import tiny_onnx

    _, graph = import_graph(tiny_onnx("llama", dynamo=dynamo, with_past=True))
    before = gs.export_onnx(graph, do_type_check=False).SerializeToString(deterministic=True)
    light, weights = light_model(graph)
    constants = {name: t for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    large = {name for name, t in constants.items() if int(np.prod(t.shape, dtype=np.int64)) * 8 > LIGHT_WEIGHT_LIMIT}
    assert set(weights) == large and len(large) >= 9  # the embedding and each layer's projections at least
    inputs = {i.name: i for i in light.graph.input}
    for name in large:
        tensor_type = inputs[name].type.tensor_type
        assert tensor_type.elem_type == dtype_to_onnx(constants[name].dtype)
        assert [d.dim_value for d in tensor_type.shape.dim] == list(constants[name].shape)
    assert {i.name for i in light.graph.initializer} == set(constants) - large
    assert light.ByteSize() < sum(constants[name].values.nbytes for name in large) / 4  # none of their bytes
    assert _shapes(light) == _shapes(gs.export_onnx(graph, do_type_check=False))
    assert gs.export_onnx(graph, do_type_check=False).SerializeToString(deterministic=True) == before


def test_a_small_sparse_constant_stays_a_sparse_initializer():
    from onnx import TensorProto, helper, numpy_helper

    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "bias")
    indices = numpy_helper.from_array(np.array([0, 3], np.int64), "bias_indices")
    sparse = helper.make_sparse_tensor(values, indices, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], sparse_initializer=[sparse])
    light, weights = light_model(gs.import_onnx(helper.make_model(graph)))
    assert weights == {} and not light.graph.initializer
    assert [s.values.name for s in light.graph.sparse_initializer] == ["bias"]
    assert _shapes(light) == {} and onnx.checker.check_model(light) is None


def test_a_bfloat16_weight_in_the_file_is_a_bfloat16_input():
    """graphsurgeon leaves an inline weight of a type numpy cannot name unloaded, its dtype ONNX's number."""
    from onnx import TensorProto, helper

    weight = helper.make_tensor("w", TensorProto.BFLOAT16, [32, 32], np.zeros(32 * 32, np.uint16).tobytes(), raw=True)
    graph = helper.make_graph([helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
                               helper.make_node("MatMul", ["x", "wf"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], initializer=[weight])
    imported = gs.import_onnx(helper.make_model(graph))
    imported.import_domains = None  # as a graph built in code has them: the export fills them in, on its own list
    light, weights = light_model(imported)
    assert imported.import_domains is None and [o.domain for o in light.opset_import] == [""]
    assert list(weights) == ["w"] and not light.graph.initializer
    declared = next(i for i in light.graph.input if i.name == "w").type.tensor_type
    assert declared.elem_type == TensorProto.BFLOAT16 and [d.dim_value for d in declared.shape.dim] == [32, 32]
    assert _shapes(light)["wf"] == [32, 32]
