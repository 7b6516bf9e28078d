"""HeadPartsSplitPass: a projection whose heads each carry their query and an output gate, cut per part.

Qwen3.5's and Qwen3-Next's q_proj gives each head its query and its output gate, [q | g], and the exporters
write `Reshape(x·W, [B, S, -1, 2·D])` then a Split of the last axis into two halves, before any head
transpose. AttentionFusionPass reads queries reshaped into heads straight from a projection; the pass gives
each part a projection of its own, W's columns (and the bias) of that part, reshaped into [B, S, H, D]: the
query's then one QkvFusionPass packs with the key's and the value's. The same values, the weights cut once
at compile time. Only such halves are taken: a projection cut into more parts (CodeGen's q/v/k shards,
Qwen3-Next's in_proj_qkvz) is another pass's spelling or no attention's, and stays one MatMul.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, const_ints, is_graph_output, producer, sole_consumer
from cann_llm.passes.split_interleaved_qkv import packed_projection


@dataclass
class HeadParts:
    x: gs.Tensor
    weight: gs.Constant
    bias: gs.Constant | None
    heads: int
    sizes: list[int]  # each part's width within a head
    pieces: list[gs.Tensor]  # [B, S, H, size]: the Split's outputs
    name: str


def _sizes(split: gs.Node, width: int) -> list[int] | None:
    """The parts' widths: the `split` input (opset 13 on) or attribute (before), equal parts without either;
    None when they are computed at run time."""
    if len(split.inputs) > 1 and split.inputs[1].name:
        return const_ints(split.inputs[1])
    if "split" in split.attrs:
        return [int(size) for size in split.attrs["split"]]
    count = len(split.outputs)
    return [width // count] * count if width % count == 0 else None


class SplitHeadParts(FusionPass):
    """Cut a projection whose heads are [query | gate] into one projection a half."""

    name = "HeadPartsSplitPass"
    anchor = "Split"

    def match(self, graph: gs.Graph, split: gs.Node) -> HeadParts | str:
        heads4 = split.inputs[0]
        reshape = producer(heads4, "Reshape")
        if reshape is None or sole_consumer(graph, heads4) is not split or heads4.shape is None \
                or len(heads4.shape) != 4 or not all(isinstance(d, int) for d in heads4.shape[2:]):
            return "not a split of the heads of a reshaped projection"
        heads, width = heads4.shape[2], heads4.shape[3]
        if split.attrs.get("axis", 0) not in (3, -1):
            return "not a split of each head's features"
        sizes = _sizes(split, width)
        if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1] or sum(sizes) != width \
                or any(is_graph_output(graph, t) for t in split.outputs):
            return "each head's features are not cut into two constant halves"
        found = packed_projection(reshape.inputs[0], heads * width)
        if isinstance(found, str):
            return found
        x, weight, bias, name = found
        return HeadParts(x, weight, bias, heads, sizes, list(split.outputs), name)

    def rewrite(self, graph: gs.Graph, match: HeadParts) -> None:
        width, dtype = sum(match.sizes), match.x.dtype
        batch = match.x.shape[:2] if match.x.shape is not None and len(match.x.shape) == 3 else [None, None]
        weight = np.asarray(match.weight.values)
        bias = None if match.bias is None else np.asarray(match.bias.values)
        start = 0
        for part, (piece, size) in enumerate(zip(match.pieces, match.sizes)):
            # part `part` of head h: columns h·width + start ... + size
            columns = (np.arange(match.heads)[:, None] * width + start + np.arange(size)[None, :]).reshape(-1)
            label = f"{match.name}_part{part}"
            projected = gs.Variable(label, dtype=dtype, shape=[*batch, len(columns)])
            graph.nodes.append(gs.Node("MatMul", name=label, outputs=[projected], inputs=[
                match.x, gs.Constant(f"{label}_weight", np.ascontiguousarray(weight[:, columns]))]))
            if bias is not None:
                biased = gs.Variable(f"{label}_biased", dtype=dtype, shape=projected.shape)
                graph.nodes.append(gs.Node("Add", name=f"{label}_bias", outputs=[biased], inputs=[
                    projected, gs.Constant(f"{label}_bias", np.ascontiguousarray(bias[columns]))]))
                projected = biased
            piece.inputs.clear()  # the Split gives it up
            graph.nodes.append(gs.Node("Reshape", name=f"{label}_heads", outputs=[piece], inputs=[
                projected, gs.Constant(f"{label}_shape", np.array([0, 0, match.heads, size], np.int64))]))
            start += size
