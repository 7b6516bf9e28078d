"""RotaryEmbeddingExpansionPass: a RotaryEmbedding op no attention conversion took → the standard-op
rotation AttentionFusionPass reads (cann_llm/passes/match_rotary.py).

onnxscript's opset-23 fusions (`onnxscript.rewriter.onnx_fusions`) write onnx's RotaryEmbedding on the
[B, H, S, D] heads of an attention they leave unfused, and onnxscript's `optimize_for_ort` may leave
com.microsoft's likewise; attention fusion then meets a rotation it does not know. Spelled out as
`x·cos + turn(x)·sin` over full-width tables [B, 1, S, R] (cann_llm/passes/rotary_tables.py), the rotation is
the one FusedAttention absorbs. A query and a key rotated by equal tables get the same table tensors
(onnxscript computes `Cos(freqs)` once per rotation), since the fusion asks q and k to share theirs.
Runs after the attention conversions, before AttentionFusionPass.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.pattern import FusionPass
from cann_llm.passes.rotary_tables import NodeBuilder, Rotation, rotary_tables, spell_rotation

MICROSOFT_DOMAIN = "com.microsoft"


@dataclass
class RotaryMatch:
    node: gs.Node
    x: gs.Tensor
    rotation: Rotation


def _optional(node: gs.Node, index: int) -> gs.Tensor | None:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index].name else None


class ExpandRotaryEmbedding(FusionPass):
    """Spell out the rotary ops left on attention heads, for the attention fusion."""

    name = "RotaryEmbeddingExpansionPass"
    anchor = "RotaryEmbedding"

    def run(self, graph: gs.Graph) -> PassResult:
        self._tables: dict[tuple, tuple[gs.Tensor, gs.Tensor]] = {}
        return super().run(graph)

    def _shared_tables(self, b: NodeBuilder, rotation: Rotation, x: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor]:
        key = rotation.key()
        if key not in self._tables:
            self._tables[key] = rotary_tables(b, rotation, x, seq_axis=2)
        return self._tables[key]

    def match(self, graph: gs.Graph, node: gs.Node) -> RotaryMatch | str:
        x = node.inputs[0]
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int):
            return "the input is not [B, H, S, D] with a static head size"
        head_dim = x.shape[-1]
        if node.domain == MICROSOFT_DOMAIN:
            positions, cos, sin = node.inputs[1:4]
            if float(node.attrs.get("scale", 1.0)) != 1.0 or node.attrs.get("is_packed_batching", 0):
                return "a scale or packed batching"
            if positions.shape is None or len(positions.shape) not in (1, 2):
                return "the position_ids are neither [1] nor [B, S]"
            offset = len(positions.shape) == 1
        elif (node.domain or "") in ("", "ai.onnx"):
            cos, sin, positions, offset = node.inputs[1], node.inputs[2], _optional(node, 3), False
        else:
            return f"an unknown domain {node.domain}"
        rotary_dim = int(node.attrs.get("rotary_embedding_dim", 0)) or head_dim
        if rotary_dim % 2 or rotary_dim > head_dim:
            return f"rotary_embedding_dim {rotary_dim} for heads of {head_dim}"
        return RotaryMatch(node, x, Rotation(cos, sin, positions, rotary_dim, int(node.attrs.get("interleaved", 0)), offset))

    def rewrite(self, graph: gs.Graph, match: RotaryMatch) -> None:
        node, x, rotation = match.node, match.x, match.rotation
        output = node.outputs[0]
        if output.shape is None:  # the contrib op's output may be unknown to shape inference; it is x's shape
            output.shape = list(x.shape)
        node.inputs.clear()
        node.outputs.clear()
        b = NodeBuilder(graph, node.name or "rotary")
        cos, sin = self._shared_tables(b, rotation, x)
        spell_rotation(b, x, cos, sin, rotation.rotary_dim, rotation.interleaved, output=output)
