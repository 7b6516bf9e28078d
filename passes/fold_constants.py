"""ConstantFoldingPass: evaluate what depends only on constants and on static shapes.

Results larger than `size_threshold` bytes stay computed at run time: folding a causal mask built from
max_position_embeddings would store hundreds of MB in the artifact.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs
import onnxruntime as ort
from onnx_graphsurgeon.logger import G_LOGGER

from passes.base import PassResult

DEFAULT_SIZE_THRESHOLD = 16 << 20


class FoldConstants:
    """Fold constant subgraphs (onnxruntime evaluates them)."""

    name = "ConstantFoldingPass"
    switchable = False

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD):
        self.size_threshold = size_threshold

    def run(self, graph: gs.Graph) -> PassResult:
        before = len(graph.nodes)
        # graphsurgeon warns about each node it cannot fold; those are expected, not problems
        level = G_LOGGER.severity
        G_LOGGER.severity = G_LOGGER.ERROR
        ort.set_default_logger_severity(3)
        try:
            graph.toposort()
            try:
                graph.fold_constants(size_threshold=self.size_threshold, error_ok=False)
            except Exception:  # noqa: BLE001 - onnxruntime refused the constant subgraph as a whole
                # partitioned folding evaluates each constant subgraph alone, so one that onnxruntime cannot
                # run leaves the others folded; it costs a session per partition (SmolLM2's TorchScript
                # export: 51 s against 0.9 s folded whole), so it is only the fallback
                graph.fold_constants(partitioning="basic", size_threshold=self.size_threshold)
        finally:
            G_LOGGER.severity = level
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        removed = before - len(graph.nodes)
        return PassResult(match_times=removed, effect_times=removed)
