"""HeadTransposeHoistPass: heads rotated before their transpose (GPT-J, CodeGen) → rotated after it.

GPT-J and CodeGen rotate the query and key on [B, S, H, D] with tables [B, S, 1, R] and only then move the
heads forward; AttentionFusionPass reads a rotation of [B, H, S, D] heads split from a projection
(cann_llm/passes/match_attention.py). `Transpose(0, 2, 1, 3)(rope(x))` → `rope(Transpose(x))`, the tables
transposed alike ([B, 1, S, R]): the same tensor, spelled as cann_llm/passes/match_rotary.py reads it. A table
read by several rotations is transposed once, so the query's and key's stay shared. Runs before the q/k/v
splitting passes: CodeGen's packed projection is followed to its heads through the rotation's place.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.canonicalize_layout import HEADS
from cann_llm.passes.match_attention import is_transpose
from cann_llm.passes.match_rotary import Rotary, match_rotary
from cann_llm.passes.pattern import FusionPass
from cann_llm.passes.rotary_tables import NodeBuilder, spell_rotation


@dataclass
class HoistMatch:
    node: gs.Node
    source: gs.Tensor
    rotary: Rotary


class HoistHeadTranspose(FusionPass):
    """Move the head transpose of a rotated [B, S, H, D] tensor before its rotation."""

    name = "HeadTransposeHoistPass"
    anchor = "Transpose"

    def run(self, graph: gs.Graph):
        self._tables: dict[int, gs.Tensor] = {}
        return super().run(graph)

    def match(self, graph: gs.Graph, node: gs.Node) -> HoistMatch | str:
        if not is_transpose(node, HEADS):
            return "not a head transpose"
        if graph.opset < 13:  # the rotation is spelled with Unsqueeze's axes as an input
            return "an opset before 13"
        found = match_rotary(node.inputs[0])
        if found is None:
            return "not a rotation"
        source, rotary = found
        if source.shape is None or len(source.shape) != 4 or not isinstance(source.shape[-1], int):
            return "the rotated tensor is not [B, S, H, D] with a static head size"
        for table in (rotary.cos, rotary.sin):
            if table.shape is None or len(table.shape) != 4 or table.shape[2] != 1:
                return "the tables are not [B, S, 1, R]"
        return HoistMatch(node, source, rotary)

    def _transposed(self, b: NodeBuilder, table: gs.Tensor) -> gs.Tensor:
        if id(table) not in self._tables:
            moved = b("Transpose", [table], {"perm": HEADS}, dtype=table.dtype)
            moved.shape = [table.shape[i] for i in HEADS]
            self._tables[id(table)] = moved
        return self._tables[id(table)]

    def rewrite(self, graph: gs.Graph, match: HoistMatch) -> None:
        node, source, rotary = match.node, match.source, match.rotary
        output = node.outputs[0]
        node.inputs.clear()
        node.outputs.clear()
        b = NodeBuilder(graph, node.name or "heads")
        heads = b("Transpose", [source], {"perm": HEADS}, dtype=source.dtype)
        heads.shape = [source.shape[i] for i in HEADS]
        cos, sin = self._transposed(b, rotary.cos), self._transposed(b, rotary.sin)
        spell_rotation(b, heads, cos, sin, rotary.rotary_dim, rotary.interleaved, output=output)
