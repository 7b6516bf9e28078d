"""PerSequenceRotaryPass on a hand-built paged graph whose rotary tables switch on max(position_ids): the
switch recorded whichever way the condition is written, and what cannot be served refused. (The real
exports, longrope through the engine, are in tests/test_architecture_variants.py.)"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from cann_llm.passes.per_sequence_rotary import PerSequenceRotary, rotary_switch_length
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import LAST_POSITIONS, PAGED_ATTENTION

pytestmark = pytest.mark.unit


def _graph(compare: str, threshold: int, swap: bool, extra_reader: bool = False) -> gs.Graph:
    positions = gs.Variable("position_ids", np.int64, [1, "T"])
    query, out = gs.Variable("q", np.float32, [1, "T", 8]), gs.Variable("out", np.float32)
    largest, length = gs.Variable("largest", np.int64), gs.Variable("length", np.int64)
    condition, inverse = gs.Variable("condition", np.bool_), gs.Variable("inverse", np.float32)
    short, long = gs.Constant("short", np.ones(4, np.float32)), gs.Constant("long", np.full(4, 0.5, np.float32))
    floats, column = gs.Variable("floats", np.float32), gs.Variable("column", np.float32)
    angles, cos, sin = (gs.Variable(n, np.float32) for n in ("angles", "cos", "sin"))
    nodes = [gs.Node("ReduceMax", inputs=[positions], outputs=[largest]),
             gs.Node("Add", inputs=[largest, gs.Constant("one", np.array(1, np.int64))], outputs=[length]),
             gs.Node(compare, inputs=[length, gs.Constant("L", np.array(threshold, np.int64))], outputs=[condition]),
             gs.Node("Where", inputs=[condition, *([short, long] if swap else [long, short])], outputs=[inverse]),
             gs.Node("Cast", attrs={"to": 1}, inputs=[positions], outputs=[floats]),
             gs.Node("Unsqueeze", inputs=[floats, gs.Constant("axis", np.array([-1], np.int64))], outputs=[column]),
             gs.Node("Mul", inputs=[column, inverse], outputs=[angles]),
             gs.Node("Cos", inputs=[angles], outputs=[cos]), gs.Node("Sin", inputs=[angles], outputs=[sin]),
             gs.Node(PAGED_ATTENTION.name, domain="cann", inputs=[query, gs.Variable.empty(), gs.Variable.empty(), cos, sin],
                     outputs=[out])]
    outputs = [out]
    if extra_reader:  # the batch's maximum read by something other than the switch
        nodes.append(gs.Node("Shape", inputs=[largest], outputs=[gs.Variable("shape", np.int64)]))
        outputs.append(nodes[-1].outputs[0])
    return gs.Graph(nodes=nodes, inputs=[positions, query], outputs=outputs, opset=17)


@pytest.mark.parametrize("compare, swap", [("Greater", False), ("LessOrEqual", True), ("Less", True)])
def test_the_switch_is_read_back_whichever_way_its_condition_is_written(compare, swap):
    graph = _graph(compare, 32, swap)
    assert PerSequenceRotary().run(graph).effect_times == 1
    assert LAST_POSITIONS in [t.name for t in graph.inputs]
    assert not any(n.op == "ReduceMax" for n in graph.nodes)  # the batch's maximum decides nothing now
    # max + 1 > 32 and max + 1 <= 32 flip between lengths 32 and 33; max + 1 < 32 between 31 and 32
    assert rotary_switch_length(graph) == (31 if compare == "Less" else 32)


def test_a_maximum_read_elsewhere_or_a_switch_that_never_flips_is_refused():
    with pytest.raises(AtcError) as read_elsewhere:
        PerSequenceRotary().run(_graph("Greater", 32, False, extra_reader=True))
    assert read_elsewhere.value.code == "E10055" and "Shape" in str(read_elsewhere.value)
    with pytest.raises(AtcError) as never:  # true for every length: no point where a sequence crosses
        PerSequenceRotary().run(_graph("Greater", -5, False))
    assert never.value.code == "E10055"
