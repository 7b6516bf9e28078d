"""CarriedStateRemovalPass drops a cache input only handed back as an output, and nothing else."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from cann_llm.passes.drop_carried_state import DropCarriedState

pytestmark = pytest.mark.unit


def _graph(extra_reader: str | None = None) -> gs.Graph:
    """x → Relu → y, and `past_key_values.0.sliding` → Identity → `present.0.sliding`; `extra_reader`: the input
    ("input") or the Identity's output ("identity") also read by a Neg whose output is a graph output."""
    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("Identity", ["past_key_values.0.sliding"], ["present.0.sliding"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
               helper.make_tensor_value_info("present.0.sliding", TensorProto.INT64, [])]
    if extra_reader:
        read = "past_key_values.0.sliding" if extra_reader == "input" else "present.0.sliding"
        nodes.append(helper.make_node("Neg", [read], ["negated"]))
        outputs.append(helper.make_tensor_value_info("negated", TensorProto.INT64, []))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("past_key_values.0.sliding", TensorProto.INT64, [])],
                              outputs)
    return gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_an_input_only_handed_back_is_dropped_with_its_output():
    graph = _graph()
    result = DropCarriedState().run(graph)
    assert result.effect_times == 1
    assert [t.name for t in graph.inputs] == ["x"] and [t.name for t in graph.outputs] == ["y"]
    onnx.checker.check_model(gs.export_onnx(graph), full_check=True)


@pytest.mark.parametrize("extra_reader", ["input", "identity"])
def test_state_a_node_reads_stays(extra_reader):
    graph = _graph(extra_reader)
    assert DropCarriedState().run(graph).effect_times == 0
    assert "past_key_values.0.sliding" in [t.name for t in graph.inputs]
    onnx.checker.check_model(gs.export_onnx(graph), full_check=True)
