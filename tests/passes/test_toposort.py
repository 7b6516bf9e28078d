"""`graph_utils.toposort` orders a graph as graphsurgeon's `Graph.toposort` does (so artifacts keep their
bytes), on real exports whose nodes were shuffled, and puts what an `If` branch reads from outside before the
`If`, which graphsurgeon's does not."""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from cann_llm.models.tiny import tiny_onnx
from cann_llm.passes.graph_utils import toposort


def _order(graph: gs.Graph) -> list[str]:
    return [f"{node.op}:{node.name}" for node in graph.nodes]


def _both(model: onnx.ModelProto, seed: int) -> tuple[list[str], list[str]]:
    """(graphsurgeon's order, ours) of `model` with its nodes shuffled by `seed`."""
    orders = []
    for sort in (gs.Graph.toposort, toposort):
        graph = gs.import_onnx(model)
        random.Random(seed).shuffle(graph.nodes)
        orders.append(_order(sort(graph)))
    return orders[0], orders[1]


@pytest.mark.parametrize("family,dynamo", [("llama", False), ("qwen2_moe", False), ("gemma", True), ("phi3", True)])
def test_the_order_of_a_shuffled_export_is_graphsurgeons(family, dynamo):
    model = onnx.load(tiny_onnx(family, dynamo=dynamo, with_past=True), load_external_data=False)
    for seed in range(3):
        theirs, ours = _both(model, seed)
        assert ours == theirs
        assert len(ours) == len(model.graph.node)


def _branching_model() -> onnx.ModelProto:
    """x → Relu → (an `If` whose branches read the Relu's output from outside) → Add(x)."""
    def branch(name: str, op: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["relu"], [f"{name}_out"], name=f"{name}_op")], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])

    nodes = [helper.make_node("Add", ["picked", "x"], ["y"], name="last"),
             helper.make_node("If", ["flag"], ["picked"], name="if", then_branch=branch("then", "Neg"),
                              else_branch=branch("else", "Abs")),
             helper.make_node("Relu", ["x"], ["relu"], name="first")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_value_a_branch_reads_from_outside_is_computed_before_the_branching_node():
    model = _branching_model()
    for seed in range(4):
        assert _both(model, seed)[1] == ["Relu:first", "If:if", "Add:last"]
    import onnxruntime as ort

    sorted_model = gs.export_onnx(toposort(gs.import_onnx(model)))
    session = ort.InferenceSession(sorted_model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, = session.run(None, {"x": np.array([-1.0, 2.0], np.float32), "flag": np.array(True)})
    np.testing.assert_array_equal(y, [-1.0, 0.0])


def test_a_cycle_is_refused():
    a = gs.Variable("a", dtype=np.float32)
    b = gs.Variable("b", dtype=np.float32)
    graph = gs.Graph(nodes=[gs.Node("Neg", "n1", inputs=[b], outputs=[a]), gs.Node("Neg", "n2", inputs=[a], outputs=[b])],
                     outputs=[a])
    with pytest.raises(ValueError, match="cycle"):
        toposort(graph)
