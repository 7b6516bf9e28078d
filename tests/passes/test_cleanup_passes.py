"""The cleanup passes, each alone: how many it matched and applied, what ops remain, same numbers out."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.eliminate_dead_code import EliminateDeadCode
from cann_llm.passes.eliminate_identity import EliminateIdentity
from cann_llm.passes.fold_constants import FoldConstants
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.runtime.ort_session import session_options

pytestmark = pytest.mark.unit

X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])


def _model(nodes, outputs, initializers=(), inputs=(X,)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", list(inputs), outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _apply(model, *passes):
    graph = gs.import_onnx(model)
    results = [p.run(graph) for p in passes]
    return gs.export_onnx(graph), results


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


FEEDS = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}


def test_identity_elimination_removes_pass_through_nodes():
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("Dropout", ["c"], ["d"]),
             helper.make_node("Cast", ["d"], ["e"], to=TensorProto.DOUBLE),
             helper.make_node("Identity", ["e"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 8])])
    fused, (shape, result) = _apply(model, InferShapes(), EliminateIdentity())
    assert (result.match_times, result.effect_times) == (4, 4)
    assert _ops(fused) == ["Relu", "Cast"]
    assert [o.name for o in fused.graph.output] == ["y"]
    np.testing.assert_array_equal(_run(fused, FEEDS)[0], _run(model, FEEDS)[0])


def test_identity_elimination_keeps_an_identity_from_input_to_output():
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    fused, (result,) = _apply(model, EliminateIdentity())
    assert (result.match_times, result.effect_times) == (1, 0)
    assert _ops(fused) == ["Identity"] and "graph I/O" in result.rejections[0]


def test_identity_elimination_keeps_a_cast_of_unknown_type():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Cast", ["a"], ["y"], to=TensorProto.FLOAT)]
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    fused, (result,) = _apply(model, EliminateIdentity())  # no shape inference: the type of `a` is unknown
    assert result.match_times == 0 and _ops(fused) == ["Relu", "Cast"]


def test_constant_folding_folds_constants_and_static_shapes():
    table = numpy_helper.from_array(np.arange(8, dtype=np.float32), "table")
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("Mul", ["table", "table"], ["squares"]),
             helper.make_node("Add", ["r", "squares"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [table])
    fused, (_, result) = _apply(model, InferShapes(), FoldConstants())
    assert (result.match_times, result.effect_times) == (2, 2)
    assert sorted(_ops(fused)) == ["Add", "Reshape"]
    np.testing.assert_array_equal(_run(fused, FEEDS)[0], _run(model, FEEDS)[0])


def test_constant_folding_leaves_results_over_the_size_threshold():
    nodes = [helper.make_node("ConstantOfShape", ["dims"], ["big"], value=numpy_helper.from_array(np.ones(1, np.float32))),
             helper.make_node("MatMul", ["x", "big"], ["y"])]
    dims = numpy_helper.from_array(np.array([8, 512], np.int64), "dims")
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])], [dims])
    fused, (result,) = _apply(model, FoldConstants(size_threshold=1024))
    assert "ConstantOfShape" in _ops(fused)
    assert result.effect_times == 0
    np.testing.assert_allclose(_run(fused, FEEDS)[0], _run(model, FEEDS)[0])


def test_dead_code_elimination_removes_unused_nodes_but_keeps_inputs():
    unused = helper.make_tensor_value_info("unused", TensorProto.FLOAT, [3])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["dead"]),
             helper.make_node("Neg", ["dead"], ["dead2"])]
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inputs=(X, unused))
    fused, (result,) = _apply(model, EliminateDeadCode())
    assert (result.match_times, result.effect_times) == (2, 2)
    assert _ops(fused) == ["Relu"] and [i.name for i in fused.graph.input] == ["x", "unused"]


def test_shape_inference_annotates_through_large_weights():
    weight = numpy_helper.from_array(np.ones((8, 1000), np.float32), "weight")
    nodes = [helper.make_node("MatMul", ["x", "weight"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [weight])
    graph = gs.import_onnx(model)
    result = InferShapes().run(graph)
    tensors = graph.tensors()
    assert list(tensors["h"].shape) == [2, 1000] and tensors["h"].dtype == np.float32
    assert list(tensors["y"].shape) == [2, 1000]
    assert (result.match_times, result.effect_times) == (2, 2)


def test_neutral_elements_are_removed_only_where_they_change_nothing():
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    one_double = numpy_helper.from_array(np.array(1.0, np.float64), "one_double")
    nodes = [helper.make_node("Mul", ["one", "x"], ["a"]),          # 1·x: removed
             helper.make_node("Sub", ["a", "zero"], ["b"]),         # x-0: removed
             helper.make_node("Sub", ["zero", "b"], ["c"]),         # 0-x: a negation, kept
             helper.make_node("Cast", ["c"], ["d"], to=TensorProto.DOUBLE),
             helper.make_node("Div", ["d", "one_double"], ["y"])]  # graph output: producer renamed
    model = _model(nodes, [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 8])], [one, zero, one_double])
    fused, (_, result) = _apply(model, InferShapes(), EliminateIdentity())
    assert (result.match_times, result.effect_times) == (3, 3)
    assert _ops(fused) == ["Sub", "Cast"] and [o.name for o in fused.graph.output] == ["y"]
    np.testing.assert_array_equal(_run(fused, FEEDS)[0], _run(model, FEEDS)[0])


def test_layout_canonicalization_leaves_a_key_transpose_of_the_wrong_rank_alone():
    # GPT-2's kᵀ spelling, Transpose(0, 2, 3, 1) into a MatMul, but of a rank-3 tensor: an invalid model
    # (onnxruntime refuses it) that the rule must not try to split into [B, H, S, D] views
    from cann_llm.passes.canonicalize_layout import CanonicalizeLayout

    keys = helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 3, 4])
    query = helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 4, 3])
    model = _model([helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]),
                    helper.make_node("MatMul", ["q", "kt"], ["y"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inputs=(query, keys))
    exported, (result,) = _apply(model, CanonicalizeLayout())
    assert (result.match_times, result.effect_times) == (0, 0)
    assert _ops(exported) == ["Transpose", "MatMul"]
