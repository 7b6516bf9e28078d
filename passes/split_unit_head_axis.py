"""UnitHeadAxisPass: q/k/v cut from a projection given a head axis of one (GPTBigCode's multi-query
attention) → cut from the projection itself, each piece split into heads the usual way.

GPTBigCode (StarCoder) writes `Split(Unsqueeze(c_attn(x), 1), axis 3)` into the query's width and one key
and one value head: the key and value come out as [B, 1, S, D], heads already first, with no head split the
attention fusion can follow back to a projection, and the query is reshaped from a 4-D piece. Each piece
is the same tensor as `Transpose(0, 2, 1, 3)(Reshape(piece of the projection, [0, 0, 1, n]))`, which is
what replaces it; a Reshape reading a piece (the query's into heads) reads the projection's piece directly,
the same elements in the same order. Runs before the q/k/v splitting passes and AttentionFusionPass.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from passes.pattern import FusionPass, axes_of, const_ints, producer
from passes.rotary_tables import NodeBuilder

HEADS = [0, 2, 1, 3]


@dataclass
class UnitHeadMatch:
    split: gs.Node
    projection: gs.Tensor
    sizes: list[int]


def _sizes(split: gs.Node) -> list[int] | None:
    if "split" in split.attrs:  # before opset 13
        return [int(n) for n in split.attrs["split"]]
    return const_ints(split.inputs[1]) if len(split.inputs) > 1 else None


class SplitUnitHeadAxis(FusionPass):
    """Cut q/k/v from the projection rather than from its view with a head axis of one."""

    name = "UnitHeadAxisPass"
    anchor = "Split"

    def match(self, graph: gs.Graph, node: gs.Node) -> UnitHeadMatch | str:
        unsqueeze = producer(node.inputs[0], "Unsqueeze")
        if unsqueeze is None or axes_of(unsqueeze) != [1] or len(unsqueeze.outputs[0].outputs) != 1:
            return "not a split of a projection given a head axis of one"
        projection = unsqueeze.inputs[0]
        shape = projection.shape
        if shape is None or len(shape) != 3 or not isinstance(shape[-1], int):
            return "the projection is not [B, S, N] with a static width"
        if node.attrs.get("axis", 0) not in (3, -1):
            return "not a split of the projection's width"
        sizes = _sizes(node)
        if sizes is None or len(sizes) != len(node.outputs) or sum(sizes) != shape[-1]:
            return "the split sizes are not constants covering the width"
        return UnitHeadMatch(node, projection, sizes)

    def rewrite(self, graph: gs.Graph, match: UnitHeadMatch) -> None:
        split, projection, sizes = match.split, match.projection, match.sizes
        old = list(split.outputs)
        split.inputs.clear()
        split.outputs.clear()
        b = NodeBuilder(graph, split.name or "unit_heads")
        pieces = [gs.Variable(f"{b.prefix}/piece_{i}", dtype=projection.dtype, shape=[*projection.shape[:2], n])
                  for i, n in enumerate(sizes)]
        graph.nodes.append(gs.Node("Split", name=f"{b.prefix}/Split", attrs={"axis": -1},
                                   inputs=[projection, b.const(sizes)], outputs=pieces))
        for tensor, piece, width in zip(old, pieces, sizes):
            for reader in list(tensor.outputs):
                # a Reshape lays out the same elements in the same order from either view; only a constant
                # 0 (copy the input's dim) reads the view's axes. A computed target holds the dims the
                # exporter meant (torch's exporters compute sizes, never 0 for a dim that is not empty)
                if reader.op == "Reshape" and reader.inputs[0] is tensor and 0 not in (const_ints(reader.inputs[1]) or []):
                    reader.inputs[0] = piece
            if not tensor.outputs and tensor not in graph.outputs:
                continue
            heads = b("Reshape", [piece, b.const([0, 0, 1, width])], dtype=projection.dtype)
            heads.shape = [*projection.shape[:2], 1, width]
            b("Transpose", [heads], {"perm": HEADS}, output=tensor)
