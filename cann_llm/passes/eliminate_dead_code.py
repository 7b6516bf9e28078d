"""DeadCodeEliminationPass: remove nodes and constants no graph output depends on.

Graph inputs stay, even unused ones: a compiled model keeps the signature it was exported with.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy


class EliminateDeadCode:
    """Remove what no output depends on."""

    name = "DeadCodeEliminationPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        before = len(graph.nodes)
        tidy(graph)
        removed = before - len(graph.nodes)
        return PassResult(match_times=removed, effect_times=removed)
