"""Structural matching helpers and the fusion-pass skeleton every fusion file builds on.

A fusion is a `FusionPass` with an anchor op type, `match(node) -> Match | str` (a string says why the
candidate was refused: data, not an exception) and `rewrite(graph, match)`, which inserts the fused node
and disconnects what it replaces; the run ends with one cleanup that removes what nothing uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy
from cann_llm.runtime.ops import CUSTOM_DOMAIN


def producer(tensor: gs.Tensor, *ops: str) -> gs.Node | None:
    """The node computing `tensor`, if it is one of `ops` (any op when none are given)."""
    if isinstance(tensor, gs.Constant) or not tensor.inputs:
        return None
    node = tensor.inputs[0]
    return node if not ops or node.op in ops else None


def sole_consumer(graph: gs.Graph, tensor: gs.Tensor, *ops: str) -> gs.Node | None:
    """The only node reading `tensor` (which must not be a graph output), if it is one of `ops`."""
    if len(tensor.outputs) != 1 or is_graph_output(graph, tensor):
        return None
    node = tensor.outputs[0]
    return node if not ops or node.op in ops else None


def scalar(tensor: gs.Tensor) -> float | None:
    """The value of a one-element constant, else None."""
    if not isinstance(tensor, gs.Constant) or int(np.prod(tensor.shape)) != 1:
        return None
    return float(np.asarray(tensor.values).reshape(-1)[0])


def const_ints(tensor: gs.Tensor | None) -> list[int] | None:
    """The values of a constant, flattened to ints, else None."""
    if not isinstance(tensor, gs.Constant):
        return None
    return [int(v) for v in np.asarray(tensor.values).reshape(-1)]


def axes_of(node: gs.Node) -> list[int] | None:
    """The axes of an Unsqueeze, Squeeze or Reduce op: an attribute before opset 13 (18 for reductions),
    an input from then on; None when they are not constant."""
    if "axes" in node.attrs:
        return list(node.attrs["axes"])
    return const_ints(node.inputs[1]) if len(node.inputs) > 1 else None


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """For a two-input node reading `tensor`, its other input."""
    if len(node.inputs) != 2 or tensor not in node.inputs:
        return None
    return node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return any(t is tensor for t in graph.outputs)


def same_value(a: gs.Tensor, b: gs.Tensor, depth: int = 4) -> bool:
    """Whether `a` and `b` hold the same values by construction: one tensor, equal constants, or the same
    op with the same attributes on inputs that are (`depth` levels deep). TorchScript repeats per layer what
    every layer computes alike (the rotary tables' Unsqueeze, say), where an optimiser would compute it once."""
    if a is b:
        return True
    if isinstance(a, gs.Constant) and isinstance(b, gs.Constant):
        return a.values.shape == b.values.shape and a.values.dtype == b.values.dtype \
            and bool(np.array_equal(a.values, b.values))
    first, second = producer(a), producer(b)
    if depth == 0 or first is None or second is None or (first.op, first.domain) != (second.op, second.domain) \
            or not _same_attrs(first.attrs, second.attrs) or len(first.inputs) != len(second.inputs) \
            or first.outputs.index(a) != second.outputs.index(b):
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(first.inputs, second.inputs))


def _same_attrs(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) or isinstance(b[k], np.ndarray)
        else isinstance(a[k], type(b[k])) and not isinstance(a[k], gs.Tensor) and a[k] == b[k] for k in a)


def fused_node(op: str, inputs: list[gs.Tensor], outputs: list[gs.Tensor], name: str, **attrs: Any) -> gs.Node:
    """A `cann` node that takes over `outputs` from whatever produced them."""
    for tensor in outputs:
        tensor.inputs.clear()
    return gs.Node(op, name=name, domain=CUSTOM_DOMAIN, attrs=attrs, inputs=inputs, outputs=outputs)


class FusionPass:
    """Runs `match` on every node of type `anchor` and `rewrite` on each match."""

    name = "FusionPass"
    anchor: str | tuple[str, ...] = ""  # the op type(s) a match starts from
    switchable = True

    def match(self, graph: gs.Graph, node: gs.Node) -> Any:
        raise NotImplementedError

    def rewrite(self, graph: gs.Graph, match: Any) -> None:
        raise NotImplementedError

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        anchors = (self.anchor,) if isinstance(self.anchor, str) else self.anchor
        for node in [n for n in graph.nodes if n.op in anchors]:
            if not node.outputs or not any(node in t.inputs for t in node.outputs):
                continue  # consumed by an earlier rewrite in this run
            found = self.match(graph, node)
            if isinstance(found, str):
                result.rejections.append(f"{node.name}: {found}")
                continue
            result.match_times += 1
            self.rewrite(graph, found)
            result.effect_times += 1
        if result.effect_times:  # a graph no rule changed is left as it came
            tidy(graph)
        return result
