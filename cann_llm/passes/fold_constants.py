"""ConstantFoldingPass: evaluate what depends only on constants and on static shapes, within a budget.

Results larger than `size_threshold` bytes stay computed at run time: folding a causal mask built from
max_position_embeddings would store hundreds of MB in the artifact.

The budget keeps a hostile or odd model from holding the compiler for minutes (a 3.5 MB model of nested
`If`s once folded for over 90 s): before onnxruntime evaluates anything, each foldable node's work is
estimated from its inferred shapes, and a node whose output would exceed `evaluation_bytes`, or would take
the pass's outputs past `total_bytes` (onnxruntime may hold every intermediate of the constant subgraph at
once), or whose work would take it past `work_budget`, stays in the graph (so do its consumers) and is
reported. The
estimate, not a clock, decides: the same model always folds the same way, so two compiles still give
identical bytes, and an onnxruntime run in progress cannot be interrupted anyway. `If`, `Loop` and `Scan`
are never evaluated (a loop's cost is its trip count), nor their subgraphs folded (both branches of nested
conditionals cost 2^depth evaluations); an `If` whose condition is constant from the start was replaced by
its taken branch at import (cann_llm/passes/constant_conditionals.py), one whose condition folding made constant is
inlined by graphsurgeon after the fold.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
from onnx_graphsurgeon.logger import G_LOGGER

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy, toposort
from cann_llm.passes.pattern import producer

log = logging.getLogger("atc")

DEFAULT_SIZE_THRESHOLD = 16 << 20
EVALUATION_BYTES = 64 << 20
TOTAL_BYTES = 1 << 30
# multiply-adds for MatMul-like ops, elements for the rest: well under a second of onnxruntime's time at
# these bounds (docs/reliability.md, "Constant folding budget")
WORK_BUDGET = 4 << 30
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
CONTRACTIONS = frozenset({"MatMul", "Gemm", "MatMulInteger", "Conv", "ConvTranspose", "Einsum"})


def compose_gathers(graph: gs.Graph) -> None:
    """`Gather(Gather(v, i), j)` of a 1-D v with constant indices → `Gather(v, i[j])`. onnxruntime's own
    optimizer writes `Shape(Transpose(x, p))` as `Gather(Shape(x), p)`, and a dim read from it as one more
    Gather: composed, graphsurgeon folds the static dims of `Shape(x)` they pick (Llama's rotary half-width)."""
    for node in graph.nodes:
        inner = producer(node.inputs[0], "Gather") if node.op == "Gather" else None
        if inner is None or node.attrs.get("axis", 0) != 0 or inner.attrs.get("axis", 0) != 0:
            continue
        data, first, second = inner.inputs[0], inner.inputs[1], node.inputs[1]
        if data.shape is None or len(data.shape) != 1 or not all(isinstance(t, gs.Constant) for t in (first, second)):
            continue
        picked, chosen = np.asarray(first.values), np.asarray(second.values)
        if picked.ndim != 1 or np.any((chosen < -len(picked)) | (chosen >= len(picked))):
            continue  # an index out of range stays for onnxruntime to report
        node.inputs[0] = data
        node.inputs[1] = gs.Constant(f"{node.outputs[0].name}_composed_indices", np.asarray(picked[chosen], np.int64))


class FoldConstants:
    """Fold constant subgraphs (onnxruntime evaluates them), within a work and size budget."""

    name = "ConstantFoldingPass"
    switchable = False

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD, evaluation_bytes: int = EVALUATION_BYTES,
                 total_bytes: int = TOTAL_BYTES, work_budget: int = WORK_BUDGET):
        self.size_threshold = size_threshold
        self.budget = (evaluation_bytes, total_bytes, work_budget)

    def run(self, graph: gs.Graph) -> PassResult:
        before = len(graph.nodes)
        # graphsurgeon warns about each node it cannot fold; those are expected, not problems
        level = G_LOGGER.severity
        G_LOGGER.severity = G_LOGGER.ERROR
        ort.set_default_logger_severity(3)
        try:
            compose_gathers(graph)
            toposort(graph)
            budget = _Budget(*self.budget, stored=self.size_threshold)
            try:
                graph.fold_constants(size_threshold=self.size_threshold, error_ok=False, recurse_subgraphs=False,
                                     should_exclude_node=budget.excludes)
            except Exception:  # noqa: BLE001 - onnxruntime refused the constant subgraph as a whole
                # partitioned folding evaluates each constant subgraph alone, so one that onnxruntime cannot
                # run leaves the others folded; it costs a session per partition (SmolLM2's TorchScript
                # export: 51 s against 0.9 s folded whole), so it is only the fallback
                budget = _Budget(*self.budget, stored=self.size_threshold)
                try:
                    # error_ok=False: with it True graphsurgeon's "basic" partitioning retries a failing
                    # partition unchanged until the recursion limit (minutes when each try is a session)
                    graph.fold_constants(partitioning="basic", size_threshold=self.size_threshold, error_ok=False,
                                         recurse_subgraphs=False, should_exclude_node=budget.excludes)
                except Exception as error:  # noqa: BLE001 - a partition onnxruntime cannot run: fold nothing
                    # fold_constants works on a copy until every value is computed, so `graph` is unchanged
                    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                    budget.notable.append(f"the constant subgraph: onnxruntime cannot evaluate it: {first_line}")
                    budget.rejections.append(budget.notable[-1])
        finally:
            G_LOGGER.severity = level
        for reason in budget.notable:
            log.warning("%s: not folded: %s", self.name, reason)
        tidy(graph)
        removed = before - len(graph.nodes)
        return PassResult(match_times=removed, effect_times=removed, rejections=budget.rejections)


class _Budget:
    """graphsurgeon's `should_exclude_node`: which foldable nodes are too big or too costly to evaluate.
    It may ask about a node more than once; the first answer stands, and its work is counted once.
    `rejections` lists every node refused; `notable` those whose refusal changes the result (an output
    over `stored` bytes would not have been kept anyway: a tied embedding's transpose, in every compile)."""

    def __init__(self, evaluation_bytes: int, total_bytes: int, work_budget: int, stored: int | None = None):
        self.evaluation_bytes = evaluation_bytes
        self.bytes_left = total_bytes
        self.work_left = work_budget
        self.stored = stored
        self.decided: dict[int, bool] = {}
        self.rejections: list[str] = []
        self.notable: list[str] = []

    def excludes(self, node: gs.Node) -> bool:
        if id(node) not in self.decided:
            reason = self._reason(node)
            if reason:
                self.rejections.append(f"{node.op} {node.name}: {reason}")
                if not self._unstored(node):
                    self.notable.append(self.rejections[-1])
            self.decided[id(node)] = reason is not None
        return self.decided[id(node)]

    def _unstored(self, node: gs.Node) -> bool:
        sizes = [_static_bytes(tensor) for tensor in node.outputs]
        return self.stored is not None and all(size is not None and size > self.stored for size in sizes)

    def _reason(self, node: gs.Node) -> str | None:
        if node.op in CONTROL_FLOW:
            return "control flow is evaluated at run time"
        sizes = [(tensor.name, _static_bytes(tensor)) for tensor in node.outputs]
        for name, size in sizes:
            if size is not None and size > self.evaluation_bytes:
                return f"its output {name} would hold {size} bytes (budget {self.evaluation_bytes})"
        output_bytes = sum(size or 0 for _, size in sizes)
        if output_bytes > self.bytes_left:
            return f"its outputs ({output_bytes} bytes) exceed what is left of the folding memory ({self.bytes_left})"
        work = _work(node)
        if work is None:
            return f"its shapes are unknown, so its cost cannot be bounded (a {node.op})"
        if work > self.work_left:
            return f"its cost ({work} operations) exceeds what is left of the folding budget ({self.work_left})"
        self.work_left -= work
        self.bytes_left -= output_bytes
        return None


def _static_shape(tensor: gs.Tensor) -> tuple[int, ...] | None:
    shape = tensor.shape
    if shape is None or any(not isinstance(dim, (int, np.integer)) or dim < 0 for dim in shape):
        return None
    return tuple(int(dim) for dim in shape)


def _static_bytes(tensor: gs.Tensor) -> int | None:
    shape = _static_shape(tensor)
    if shape is None or tensor.dtype is None:
        return None
    try:
        itemsize = np.dtype(tensor.dtype).itemsize
    except TypeError:  # a type numpy does not name (onnx's float8 and int4 kinds): a byte at most
        itemsize = 1
    return math.prod(shape) * itemsize


def _work(node: gs.Node) -> int | None:
    """Multiply-adds of a contraction (None when its shapes are unknown), elements of anything else (the
    larger of its inputs' and outputs' known sizes)."""
    if node.op in CONTRACTIONS:
        shapes = [_static_shape(t) for t in node.inputs[:2]]
        if len(shapes) < 2 or None in shapes or not shapes[0]:
            return None
        first, second = shapes
        # each output element sums over the contracted axis (the last of a MatMul's first input, the channels
        # of a convolution's); with the batch axes of both counted, an overestimate, never an under one
        contracted = first[1] if node.op.startswith("Conv") and len(first) > 1 else first[-1]
        return math.prod(first) * math.prod(second) // max(contracted, 1)
    sizes = [math.prod(shape) for shape in (_static_shape(t) for t in node.inputs + node.outputs) if shape is not None]
    return max(sizes, default=0)
