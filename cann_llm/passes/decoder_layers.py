"""Where a decoder's layers begin in a fused graph: each at the norm its attention's input comes from (the
nearest norm upstream whose weight spans the hidden size; Qwen3's per-head q/k norms are passed over by
that test), and the residual stream entering it. Read by the passes that cut a decoder by layers
(cann_llm/passes/truncate_layers.py, cann_llm/passes/pipeline_stages.py)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

NORMS = ("RmsNorm", "AddRmsNorm", "LayerNormalization")


def norm_weight(node: gs.Node) -> gs.Tensor:
    """A norm's scale: an AddRmsNorm's third input, another norm's second."""
    return node.inputs[2] if node.op == "AddRmsNorm" else node.inputs[1]


def norm_above(tensor: gs.Tensor, hidden: int | None) -> gs.Node | None:
    """The nearest norm over the hidden size that `tensor` is computed from (breadth first)."""
    frontier, seen = [tensor], set()
    while frontier:
        following = []
        for t in frontier:
            if id(t) in seen or not t.inputs:
                continue
            seen.add(id(t))
            node = t.inputs[0]
            weight = norm_weight(node) if node.op in NORMS else None
            if isinstance(weight, gs.Constant) and (hidden is None or weight.shape[-1] == hidden):
                return node
            following += [i for i in node.inputs if isinstance(i, gs.Variable)]
        frontier = following
    return None


def residual_entering(norm: gs.Node) -> gs.Tensor:
    """The residual stream a layer starts from: an AddRmsNorm's sum, or a plain norm's input."""
    return norm.outputs[1] if norm.op == "AddRmsNorm" else norm.inputs[0]
