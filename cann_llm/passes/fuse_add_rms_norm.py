"""AddRmsNormFusionPass: a residual Add feeding an RmsNorm → cann::AddRmsNorm, which also outputs the
sum (the next residual reads it). Runs after RmsNormFusionPass."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, fused_node, producer
from cann_llm.runtime.ops import CUSTOM_DOMAIN


@dataclass
class AddRmsNormMatch:
    add: gs.Node
    norm: gs.Node


def _same_shape(a: gs.Tensor, b: gs.Tensor) -> bool:
    """Both shapes known to the same rank and hidden size, with no dimension broadcast."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape) or a.shape[-1] != b.shape[-1]:
        return False
    return all(x == y or (x != 1 and y != 1) for x, y in zip(a.shape, b.shape))


class FuseAddRmsNorm(FusionPass):
    """Fold residual adds into the following RmsNorm."""

    name = "AddRmsNormFusionPass"
    anchor = "RmsNorm"

    def match(self, graph: gs.Graph, norm: gs.Node) -> AddRmsNormMatch | str:
        if norm.domain != CUSTOM_DOMAIN:
            return "not a cann::RmsNorm"
        add = producer(norm.inputs[0], "Add")
        if add is None:
            return "the input is not produced by an Add"
        left, right = add.inputs
        if isinstance(left, gs.Constant) or isinstance(right, gs.Constant):
            return "the Add has a constant operand (a bias, not a residual)"
        if not _same_shape(left, right):
            return f"the Add broadcasts ({left.shape} + {right.shape})"
        # a per-head sum (HunYuan normalises q and k after their rotary) is no residual stream, and the op's
        # onnxruntime lowering (SkipSimplifiedLayerNormalization) takes two or three dims only
        if len(left.shape) not in (2, 3):
            return f"not a residual stream of [B, S, H] or [T, H] ({left.shape})"
        return AddRmsNormMatch(add, norm)

    def rewrite(self, graph: gs.Graph, match: AddRmsNormMatch) -> None:
        norm, add = match.norm, match.add
        inputs = [add.inputs[0], add.inputs[1], norm.inputs[1]]
        outputs = [norm.outputs[0], add.outputs[0]]
        norm.inputs.clear()
        graph.nodes.append(fused_node("AddRmsNorm", inputs, outputs, norm.name.replace("RmsNorm", "AddRmsNorm"),
                                      epsilon=norm.attrs["epsilon"]))
