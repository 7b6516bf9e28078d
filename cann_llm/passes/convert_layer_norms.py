"""onnxruntime's RMS normalisations → cann::RmsNorm and cann::AddRmsNorm.

onnxruntime's transformer optimizer, onnxscript's `optimize_for_ort` and the onnxruntime-genai model
builder write `SimplifiedLayerNormalization` (default domain, registered by onnxruntime, not by onnx) and
`com.microsoft.SkipSimplifiedLayerNormalization` (reference/PEERS.md §4.4-4.5). Both are the cann ops
renamed when the normalisation is over the last axis alone in float32 with a scale of one value per
element, and the statistics outputs (mean, inv_std_var) are not read. A Skip with a bias becomes the sum
spelled out (input + skip + bias, in that order) and an RmsNorm, since AddRmsNorm adds no bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, fused_node, is_graph_output
from cann_llm.passes.rotary_tables import NodeBuilder

FLOAT32 = 1
MICROSOFT_DOMAIN = "com.microsoft"


@dataclass
class NormMatch:
    node: gs.Node


def _present(node: gs.Node, index: int) -> bool:
    return index < len(node.inputs) and bool(node.inputs[index].name)


def _read(graph: gs.Graph, node: gs.Node, index: int) -> bool:
    """Whether output `index` of `node` exists and something reads it (a consumer or the graph)."""
    if index >= len(node.outputs) or not node.outputs[index].name:
        return False
    tensor = node.outputs[index]
    return bool(tensor.outputs) or is_graph_output(graph, tensor)


def _scale_refusal(x: gs.Tensor, scale: gs.Tensor) -> str | None:
    # x's shape may be unknown behind a contrib op; the op itself holds a 1-D scale to x's last dim
    if scale.shape is None or len(scale.shape) != 1 or (x.shape is not None and scale.shape[0] != x.shape[-1]):
        return "the scale is not one value per normalised element"
    return None


class ConvertSimplifiedLayerNorm(FusionPass):
    """SimplifiedLayerNormalization → cann::RmsNorm."""

    name = "SimplifiedLayerNormConversionPass"
    anchor = "SimplifiedLayerNormalization"

    def match(self, graph: gs.Graph, node: gs.Node) -> NormMatch | str:
        if (node.domain or "") not in ("", "ai.onnx"):
            return "not onnxruntime's default-domain SimplifiedLayerNormalization"
        x, scale = node.inputs[0], node.inputs[1]
        last = (-1, len(x.shape) - 1) if x.shape is not None else (-1,)
        if node.attrs.get("axis", -1) not in last:
            return "the normalisation is not over the last axis alone"
        if node.attrs.get("stash_type", FLOAT32) != FLOAT32:
            return "the compute type is not float32"
        if _read(graph, node, 1):
            return "inv_std_var is read"
        return _scale_refusal(x, scale) or NormMatch(node)

    def rewrite(self, graph: gs.Graph, match: NormMatch) -> None:
        node = match.node
        inputs = list(node.inputs[:2])
        node.inputs.clear()
        graph.nodes.append(fused_node("RmsNorm", inputs, [node.outputs[0]], f"{node.name}_RmsNorm",
                                      epsilon=float(node.attrs.get("epsilon", 1e-5))))


class ConvertSkipSimplifiedLayerNorm(FusionPass):
    """SkipSimplifiedLayerNormalization → cann::AddRmsNorm (or, with a bias, Add + Add + cann::RmsNorm)."""

    name = "SkipSimplifiedLayerNormConversionPass"
    anchor = "SkipSimplifiedLayerNormalization"

    def match(self, graph: gs.Graph, node: gs.Node) -> NormMatch | str:
        if node.domain != MICROSOFT_DOMAIN:
            return "not com.microsoft's SkipSimplifiedLayerNormalization"
        x, skip, gamma = node.inputs[:3]
        if _read(graph, node, 1) or _read(graph, node, 2):
            return "the mean or inv_std_var output is read"
        if x.shape is None or skip.shape is None or list(x.shape) != list(skip.shape):
            return f"the skip's shape {skip.shape} is not the input's {x.shape}"
        if _present(node, 3) and _scale_refusal(x, node.inputs[3]):
            return "the bias is not one value per element"
        return _scale_refusal(x, gamma) or NormMatch(node)

    def rewrite(self, graph: gs.Graph, match: NormMatch) -> None:
        node = match.node
        x, skip, gamma = node.inputs[:3]
        bias = node.inputs[3] if _present(node, 3) else None
        y = node.outputs[0]
        total = node.outputs[3] if len(node.outputs) > 3 and node.outputs[3].name else None
        epsilon = float(node.attrs.get("epsilon", 1e-5))
        node.inputs.clear()
        node.outputs.clear()
        if bias is None:
            outputs = [y] + ([total] if total is not None else [])
            graph.nodes.append(fused_node("AddRmsNorm", [x, skip, gamma], outputs, f"{node.name}_AddRmsNorm",
                                          epsilon=epsilon))
            return
        add = NodeBuilder(graph, node.name)
        partial = add("Add", [x, skip], dtype=x.dtype)
        total = add("Add", [partial, bias], output=total, dtype=x.dtype)
        graph.nodes.append(fused_node("RmsNorm", [total, gamma], [y], f"{node.name}_RmsNorm", epsilon=epsilon))
