"""Constant folding within its budget: huge or costly folds are skipped and reported, never computed;
`If`s on constant conditions are replaced by their taken branch at import, so nested ones compile in
seconds. Every rewritten graph is checked against onnxruntime on the original."""

from __future__ import annotations

import logging
import time

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import compile_to, ort_reference
from onnx import TensorProto, helper, numpy_helper

from cann_llm.compiler.loader import import_graph
from cann_llm.models.nested_conditionals import nested_conditionals
from cann_llm.passes.fold_constants import FoldConstants
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.runtime import Executor, load_artifact

vi = helper.make_tensor_value_info


def _save(tmp_path, nodes, inputs, outputs, initializers=(), name="m.onnx"):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _ort(model, feeds) -> list[np.ndarray]:
    session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _folded(path, **budget) -> tuple[gs.Graph, list[str]]:
    _, graph = import_graph(path)
    InferShapes().run(graph)
    return graph, FoldConstants(**budget).run(graph).rejections


@pytest.mark.unit
def test_a_fold_whose_output_would_exceed_the_budget_is_never_computed(tmp_path):
    shape = numpy_helper.from_array(np.array([1 << 20, 1 << 20], np.int64), "shape")  # 4 TiB of float32
    path = _save(tmp_path, [helper.make_node("ConstantOfShape", ["shape"], ["big"]),
                            helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
                            helper.make_node("Add", ["x", "total"], ["y"])],
                 [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])], [shape])
    graph, rejections = _folded(path)
    assert [node.op for node in graph.nodes] == ["ConstantOfShape", "ReduceSum", "Add"]
    assert rejections == [f"ConstantOfShape {graph.nodes[0].name}: its output big would hold {4 << 40} bytes "
                          f"(budget {64 << 20})"]


@pytest.mark.unit
def test_folds_past_the_work_budget_are_skipped_and_reported_and_the_rest_folded(tmp_path):
    weight = numpy_helper.from_array(np.eye(64, dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["w", "w"], ["w2"]), helper.make_node("MatMul", ["w2", "w"], ["w3"]),
             helper.make_node("MatMul", ["x", "w3"], ["y"])]
    path = _save(tmp_path, nodes, [vi("x", TensorProto.FLOAT, [1, 64])], [vi("y", TensorProto.FLOAT, [1, 64])], [weight])
    graph, rejections = _folded(path, work_budget=64**3)  # room for one 64×64 product, not two
    assert [node.op for node in graph.nodes] == ["MatMul", "MatMul"]
    assert len(rejections) == 1 and "exceeds what is left of the folding budget (0)" in rejections[0]
    x = np.arange(64, dtype=np.float32).reshape(1, 64)
    np.testing.assert_array_equal(_ort(gs.export_onnx(graph).SerializeToString(), {"x": x})[0], x)
    graph, rejections = _folded(path)
    assert [node.op for node in graph.nodes] == ["MatMul"] and rejections == []


@pytest.mark.unit
def test_folds_past_the_memory_budget_are_skipped(tmp_path):
    # onnxruntime may hold every intermediate of a constant chain at once: 264 × 64 MiB once took 21 GB
    constant = numpy_helper.from_array(np.ones(1 << 18, np.float32), "c")  # 1 MiB
    nodes = [helper.make_node("Neg", ["c"], ["n0"]), helper.make_node("Neg", ["n0"], ["n1"]),
             helper.make_node("Neg", ["n1"], ["n2"]), helper.make_node("Add", ["x", "n2"], ["y"])]
    path = _save(tmp_path, nodes, [vi("x", TensorProto.FLOAT, [1 << 18])], [vi("y", TensorProto.FLOAT, [1 << 18])],
                 [constant])
    graph, rejections = _folded(path, total_bytes=2 << 20)
    assert [node.op for node in graph.nodes] == ["Neg", "Add"]
    assert rejections == [f"Neg {graph.nodes[0].name}: its outputs ({1 << 20} bytes) exceed what is left of the "
                          "folding memory (0)"]


@pytest.mark.unit
def test_constant_conditions_take_their_branch_at_import_and_compute_the_same(tmp_path):
    constant = numpy_helper.from_array(np.full((3,), 2.0, np.float32), "two")
    returns_constant = helper.make_graph([], "then", [], [vi("two", TensorProto.FLOAT, [3])], [constant])  # no node
    doubles = helper.make_graph([helper.make_node("Add", ["x", "x"], ["twice"])], "else", [],
                                [vi("twice", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("Constant", [], ["yes"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("Constant", [], ["no"], value=numpy_helper.from_array(np.array([False]))),
             helper.make_node("If", ["yes"], ["a"], then_branch=returns_constant, else_branch=doubles),
             helper.make_node("If", ["no"], ["b"], then_branch=returns_constant, else_branch=doubles),
             helper.make_node("Mul", ["a", "b"], ["y"])]
    path = _save(tmp_path, nodes, [vi("x", TensorProto.FLOAT, [3])], [vi("y", TensorProto.FLOAT, [3])])
    _, graph = import_graph(path)
    assert "If" not in {node.op for node in graph.nodes}
    x = np.array([1.0, -2.0, 0.5], np.float32)
    np.testing.assert_array_equal(_ort(gs.export_onnx(graph).SerializeToString(), {"x": x})[0], _ort(path, {"x": x})[0])


def test_a_model_of_nested_constant_conditionals_compiles_in_seconds_and_computes_the_same(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="atc")  # an earlier `atc` run in this process may have raised it
    path = nested_conditionals(tmp_path / "nested.onnx", depth=10)
    assert 3 << 20 < path.stat().st_size < 4 << 20
    start = time.perf_counter()
    om = compile_to(path, tmp_path / "nested")
    # 77 s at depth 8 when every level's two branches were visited (4x that per two levels more); a bound
    # a loaded machine meets many times over, not a measurement
    assert time.perf_counter() - start < 90
    loaded = load_artifact(om)
    ops = [node.op_type for node in loaded.om.graph().graph.node]
    # 40 products of 900^3 multiply-adds each: the budget folds 5 a run and leaves the rest to run time
    skipped = [r for r in caplog.records if "exceeds what is left of the folding budget" in r.getMessage()]
    assert "If" not in ops and "MatMul" in ops and skipped
    x = np.random.default_rng(1).standard_normal((900, 900)).astype(np.float32)
    # onnxruntime's own optimiser folds both branches of every level too (72 s here): the reference runs unoptimised
    expected = ort_reference(path, {"x": x})["y"]
    np.testing.assert_allclose(Executor(loaded).run({"x": x})["y"], expected, rtol=1e-4, atol=1e-5)


def _subgraph_initializers(graph: onnx.GraphProto) -> list[str]:
    names = []
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                names += [t.name for t in sub.initializer] + _subgraph_initializers(sub)
    return names


def test_conditionals_on_a_run_time_flag_keep_one_copy_of_their_weight_and_compute_the_same(tmp_path):
    path = nested_conditionals(tmp_path / "flagged.onnx", depth=4, run_time=True)
    loaded = load_artifact(compile_to(path, tmp_path / "flagged"))
    graph = loaded.om.graph().graph
    # graphsurgeon exports an outer constant into every subgraph that reads it (14 copies of w here); the
    # top level folded its own use of w away, so each of the two outermost branches keeps one
    assert "If" in {node.op_type for node in graph.node} and _subgraph_initializers(graph).count("w") == 2
    x = np.random.default_rng(2).standard_normal((900, 900)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_allclose(Executor(loaded).run(feeds)["y"], ort_reference(path, feeds)["y"], rtol=1e-4,
                                   atol=1e-5, err_msg=f"flag={flag}")


def test_gathers_of_a_shape_compose_and_fold_each_to_its_own_dim():
    """onnxruntime writes a dim of `Shape(Transpose(x, p))` as Gather(Gather(Shape(x), p), j): composed, the
    static dims fold. Two such chains in nodes without names (names are optional) keep their own indices:
    the batch (known only at run time) stays computed, dim 3's static 4 folds."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 4, 5])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i"], ["a"]), helper.make_node("Gather", ["a", "j"], ["batch"]),
             helper.make_node("Gather", ["s", "i2"], ["a2"]), helper.make_node("Gather", ["a2", "j2"], ["width"])]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("i", [0, 2]), ("j", 0), ("i2", [3, 2]),
                                                                            ("j2", 1))]
    outputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("batch", "width")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits), opset_imports=[helper.make_opsetid("", 17)])
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    FoldConstants().run(graph)
    assert isinstance(graph.outputs[1], gs.Constant) and int(graph.outputs[1].values) == 4
    folded = gs.export_onnx(graph)
    for batch in (2, 7):
        got = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.zeros((batch, 3, 4, 5), np.float32)})
        assert [int(v) for v in got] == [batch, 4]
