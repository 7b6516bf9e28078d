"""DeadCodeEliminationPass: remove nodes and constants no graph output depends on.

Graph inputs stay, even unused ones: a compiled model keeps the signature it was exported with.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult


class EliminateDeadCode:
    """Remove what no output depends on."""

    name = "DeadCodeEliminationPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        before = len(graph.nodes)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        removed = before - len(graph.nodes)
        return PassResult(match_times=removed, effect_times=removed)
