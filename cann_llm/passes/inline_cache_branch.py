"""CacheBranchInliningPass: the with-cache branch of a merged decoder, as the graph.

Optimum before its single-graph exports (and the many `decoder_model_merged.onnx` files made by it that
are still in use) merged the decoder without a cache and the decoder with one into one model: an `If`
on a boolean input (`use_cache_branch`) whose then- and else-branches are the two decoders, their weights
shared in the outer graph. The branch that reads the past keys and values (the graph's rank-4 float
inputs) computes a prompt too, given a past of length 0, which is how the single-graph exports work, so
it replaces the `If` and the condition input goes: every later pass sees one decoder with a cache.

Except where that branch was traced for one new token: transformers before 4.38 (and GPT-2's sdpa,
4.42 to 4.51) made no causal mask for a single query, so Optimum's decoder with a cache compares no positions
while the one without compares them. That branch is right only a token at a time, and the one without a
cache replaces the `If` instead (its past inputs go too): a paged compile gives it a cache all the same, a
contiguous one recomputes the sequence each step. Where the `If` does not compute the graph's outputs, or
the branch that reads the past is not one, the graph is left as it is.
"""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses, tidy
from cann_llm.passes.match_attention import dtype_kind

log = logging.getLogger(__name__)


_COMPARISONS = ("LessOrEqual", "GreaterOrEqual", "Less", "Greater", "Trilu")


def _compares_positions(branch: gs.Graph) -> bool:
    """Whether a branch (or a graph nested in it) compares anything, as a causal mask does."""
    return any(node.op in _COMPARISONS or any(isinstance(v, gs.Graph) and _compares_positions(v)
                                              for v in node.attrs.values()) for node in branch.nodes)


def _reads(branch: gs.Graph) -> set[int]:
    """ids of the tensors a branch's nodes read, its nested subgraphs included."""
    read = set()
    for node in branch.nodes:
        read.update(id(t) for t in node.inputs)
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                read |= _reads(value)
    return read


class InlineCacheBranch:
    """Replaces a merged decoder's `If` by its branch with a KV cache."""

    name = "CacheBranchInliningPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        past = {id(t) for t in graph.inputs
                if t.shape is not None and len(t.shape) == 4 and dtype_kind(t.dtype) in "fV"}
        outputs = {id(t) for t in graph.outputs}
        for node in [n for n in graph.nodes if n.op == "If"]:
            condition = node.inputs[0]
            if id(condition) not in {id(t) for t in graph.inputs} or not outputs & {id(t) for t in node.outputs}:
                continue
            result.match_times += 1
            reading = [name for name in ("then_branch", "else_branch") if past & _reads(node.attrs[name])]
            if len(reading) != 1:
                result.rejections.append(f"{node.name}: {len(reading)} branches read the past keys and values")
                continue
            chosen = reading[0]
            other = "else_branch" if chosen == "then_branch" else "then_branch"
            if not _compares_positions(node.attrs[chosen]) and _compares_positions(node.attrs[other]):
                log.warning("%s: %s's branch with a cache masks no positions (traced for one new token), so its "
                            "branch without a cache is compiled", self.name, node.name)
                chosen = other
            branch = node.attrs[chosen]
            local = {id(t) for n in branch.nodes for t in n.outputs}
            if len(branch.outputs) != len(node.outputs) or any(id(t) not in local for t in branch.outputs):
                result.rejections.append(f"{node.name}: a branch output is not computed in the branch")
                continue
            self._inline(graph, node, branch)
            # the condition, and the past where the branch without a cache was taken, are read no more
            graph.inputs = [t for t in graph.inputs if t.outputs or (t is not condition and id(t) not in past)]
            result.effect_times += 1
            log.info("%s: %s's %s inlined", self.name, node.name, chosen)
        if result.effect_times:
            tidy(graph)
        return result

    @staticmethod
    def _inline(graph: gs.Graph, node: gs.Node, branch: gs.Graph) -> None:
        taken = set(graph.tensors())
        kept = {id(t) for t in branch.outputs}
        for moved in branch.nodes:
            for tensor in moved.outputs:
                if tensor.name in taken and id(tensor) not in kept:
                    tensor.name = f"{tensor.name}/{branch.name}"
        graph.nodes.extend(branch.nodes)
        for replaced, computed in zip(list(node.outputs), branch.outputs):
            output = any(t is replaced for t in graph.outputs)
            replace_all_uses(graph, replaced, computed)
            if output:
                computed.name = replaced.name
        node.outputs.clear()
        node.inputs.clear()
        # the other branch's nodes still read the outer graph's tensors (graphsurgeon lists them among
        # their consumers) until they let go
        for other in node.attrs.values():
            if isinstance(other, gs.Graph) and other is not branch:
                _let_go(other)


def _let_go(branch: gs.Graph) -> None:
    """Detaches every node of `branch`, and of the graphs nested in it, from the tensors it reads. By
    identity: graphsurgeon's own detaching removes the first node *equal* to it, and the two branches hold
    nodes equal in name and op (the same model traced twice), so it would detach the kept branch's."""
    for node in branch.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                _let_go(value)
        for tensors, links in ((node.inputs, "outputs"), (node.outputs, "inputs")):
            for tensor in tensors:
                linked = getattr(tensor, links)
                list.pop(linked, next(i for i, other in enumerate(linked) if other is node))
            list.clear(tensors)
