"""RmsNormalizationConversionPass: ONNX's own RMSNormalization (opset 23) → cann::RmsNorm.

Only the form RmsNorm expresses: normalisation over the last axis alone, a float32 compute type (the
stash_type default), a scale of the normalised size. Other forms stay, and run as the standard op.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, fused_node

FLOAT32 = 1


@dataclass
class RmsNormalizationMatch:
    node: gs.Node


class ConvertRmsNormalization(FusionPass):
    """Rename the standard RMS normalisation into the cann op the later passes and the runtime know."""

    name = "RmsNormalizationConversionPass"
    anchor = "RMSNormalization"

    def match(self, graph: gs.Graph, node: gs.Node) -> RmsNormalizationMatch | str:
        x, scale = node.inputs[0], node.inputs[1]
        rank = len(x.shape) if x.shape is not None else None
        if rank is None or node.attrs.get("axis", -1) not in (-1, rank - 1):
            return "the normalisation is not over the last axis alone"
        if node.attrs.get("stash_type", FLOAT32) != FLOAT32:
            return "the compute type is not float32"
        if scale.shape is None or len(scale.shape) != 1 or scale.shape[0] != x.shape[-1]:
            return "the scale is not one value per normalised element"
        return RmsNormalizationMatch(node)

    def rewrite(self, graph: gs.Graph, match: RmsNormalizationMatch) -> None:
        node = match.node
        inputs = list(node.inputs)
        node.inputs.clear()
        graph.nodes.append(fused_node("RmsNorm", inputs, [node.outputs[0]], f"{node.name}_RmsNorm",
                                      epsilon=float(node.attrs.get("epsilon", 1e-5))))
