"""UnitHeadAxisPass: q/k/v cut from a projection given a head axis of one (GPTBigCode's multi-query
attention) → cut from the projection itself, each piece split into heads the usual way.

GPTBigCode (StarCoder) writes `Split(Unsqueeze(c_attn(x), 1), axis 3)` into the query's width and one key
and one value head: the key and value come out as [B, 1, S, D], heads already first, with no head split the
attention fusion can follow back to a projection, and the query is reshaped from a 4-D piece. Each piece
is the same tensor as `Transpose(0, 2, 1, 3)(Reshape(piece of the projection, [0, 0, 1, n]))`, which is
what replaces it; a Reshape reading a piece (the query's into heads) reads the projection's piece directly,
the same elements in the same order, unless its target copies one of the piece's axes (a 0). Runs before
the q/k/v splitting passes and AttentionFusionPass.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.canonicalize_layout import HEADS
from cann_llm.passes.graph_utils import split_into
from cann_llm.passes.pattern import FusionPass, axes_of, const_ints, producer
from cann_llm.passes.rotary_tables import NodeBuilder
from cann_llm.passes.shape_values import shape_elements


@dataclass
class UnitHeadMatch:
    split: gs.Node
    projection: gs.Tensor
    sizes: list[int]


def _sizes(split: gs.Node) -> list[int] | None:
    if len(split.inputs) > 1 and split.inputs[1].name:  # opset 13 on; an empty name is no input
        return const_ints(split.inputs[1])
    sizes = split.attrs.get("split")  # before opset 13; opset 18's num_outputs alone gives none
    return [int(n) for n in sizes] if sizes is not None else None


def _reads_the_elements(reshape: gs.Node, tensor: gs.Tensor) -> bool:
    """Whether `reshape` lays out `tensor`'s elements by a target of its own: one whose elements can be read
    and copy none of the input's axes (no 0, unless `allowzero` makes a 0 a 0)."""
    if reshape.inputs[0] is not tensor:
        return False
    target = shape_elements(reshape.inputs[1])
    return target is not None and (reshape.attrs.get("allowzero", 0) == 1 or 0 not in target)


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
        split_into(graph, projection, sizes, pieces, f"{b.prefix}/Split")
        for tensor, piece, width in zip(old, pieces, sizes):
            for reader in list(tensor.outputs):
                if reader.op == "Reshape" and _reads_the_elements(reader, tensor):
                    reader.inputs[0] = piece
            if not tensor.outputs and tensor not in graph.outputs:
                continue
            heads = b("Reshape", [piece, b.const([0, 0, 1, width])], dtype=projection.dtype)
            heads.shape = [*projection.shape[:2], 1, width]
            b("Transpose", [heads], {"perm": HEADS}, output=tensor)
