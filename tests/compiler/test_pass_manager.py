"""The pass runner: its report, and its progress line per pass (counts and time) only when asked."""

from __future__ import annotations

import re

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from cann_llm.compiler.pass_manager import run_passes
from cann_llm.passes.base import PassResult
from cann_llm.passes.eliminate_identity import EliminateIdentity

pytestmark = pytest.mark.unit


class _Bypass:
    """Counts the Relu nodes as candidates and drops one: enough to tell the runner's numbers apart."""

    switchable = True

    def __init__(self, name: str = "ReluDropPass"):
        self.name = name

    def run(self, graph: gs.Graph) -> PassResult:
        relus = [n for n in graph.nodes if n.op == "Relu"]
        relus[-1].outputs[0].inputs.clear()
        graph.outputs = [relus[-1].inputs[0]]
        graph.cleanup()
        return PassResult(match_times=len(relus), effect_times=1)


def _graph() -> gs.Graph:
    x = gs.Variable("x", np.float32, [2])
    hidden, y = gs.Variable("h", np.float32, [2]), gs.Variable("y", np.float32, [2])
    return gs.Graph(nodes=[gs.Node("Relu", inputs=[x], outputs=[hidden]), gs.Node("Relu", inputs=[hidden], outputs=[y])],
                    inputs=[x], outputs=[y])


def test_each_pass_reports_one_line_in_order_with_counts_and_time_or_that_it_was_switched_off(capsys):
    passes = [_Bypass(), _Bypass("SwitchedOffFusionPass"), EliminateIdentity(), _Bypass()]
    report = run_passes(_graph(), passes, {"SwitchedOffFusionPass": False}, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [r.name for r in report.records] == [p.name for p in passes]
    assert re.fullmatch(r"\[1/4\] ReluDropPass {13}matched 2, applied 1  \d+\.\d\d s", lines[0]), lines
    assert lines[1] == "[2/4] SwitchedOffFusionPass    switched off"
    assert re.fullmatch(r"\[3/4\] IdentityEliminationPass  matched 0, applied 0  \d+\.\d\d s", lines[2]), lines
    assert re.fullmatch(r"\[4/4\] ReluDropPass {13}matched 1, applied 1  \d+\.\d\d s", lines[3]), lines
    assert len(lines) == 4 and report.nodes_before == 2 and report.nodes_after == 0


def test_the_runner_is_silent_unless_asked(capsys):
    run_passes(_graph(), [_Bypass()], {})
    assert capsys.readouterr().err == ""
