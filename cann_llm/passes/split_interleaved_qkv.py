"""InterleavedQkvSplitPass: a q/k/v projection packed head by head, reordered into three blocks.

GPT-NeoX (Pythia) projects q, k and v in one linear layer whose columns run head by head, each head's
[q | k | v] side by side: the exporters write `Reshape(x·W + b, [B, S, H, 3·D])`, the (0, 2, 1, 3)
transpose, then a Split or three Slices of the last axis. The pass permutes W's columns (and b's) into
[all q | all k | all v], so the projection is cut by Slices and each third split into heads as Llama's
are: the spelling AttentionFusionPass reads, and QkvFusionPass then feeds the packed projection to the
attention whole. The same values, the weights reordered once at compile time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, const_ints, is_graph_output, producer, sole_consumer


@dataclass
class InterleavedQkv:
    x: gs.Tensor
    weight: gs.Constant
    bias: gs.Constant | None
    heads: int
    head_dim: int
    pieces: list[gs.Tensor]  # [B, H, S, D]: q, k and v as the graph reads them
    name: str


def _thirds(graph: gs.Graph, tensor: gs.Tensor, head_dim: int) -> list[gs.Tensor] | None:
    """q, k and v: `tensor` [B, H, S, 3·D] cut into three on its last axis by a Split or three Slices."""
    readers = tensor.outputs
    if is_graph_output(graph, tensor) or not readers:
        return None
    if len(readers) == 1 and readers[0].op == "Split" and len(readers[0].outputs) == 3:
        split = readers[0]
        sizes = const_ints(split.inputs[1]) if len(split.inputs) > 1 else [head_dim] * 3
        if split.attrs.get("axis", 0) in (3, -1) and sizes == [head_dim] * 3:
            return list(split.outputs)
        return None
    pieces: dict[int, gs.Tensor] = {}
    for node in readers:
        if node.op != "Slice" or len(node.inputs) < 4:
            return None
        starts, ends, axes = (const_ints(t) for t in node.inputs[1:4])
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
        if None in (starts, ends, axes, steps) or axes not in ([3], [-1]) or steps != [1] \
                or starts[0] % head_dim or min(ends[0], 3 * head_dim) - starts[0] != head_dim:
            return None
        pieces[starts[0] // head_dim] = node.outputs[0]
    return [pieces[i] for i in range(3)] if sorted(pieces) == [0, 1, 2] else None


class SplitInterleavedQkv(FusionPass):
    """Reorder a head-by-head packed q/k/v projection into [q | k | v] blocks cut by Slices."""

    name = "InterleavedQkvSplitPass"
    anchor = "Transpose"

    def match(self, graph: gs.Graph, transpose: gs.Node) -> InterleavedQkv | str:
        if list(transpose.attrs.get("perm", [])) != [0, 2, 1, 3]:
            return "not a (0, 2, 1, 3) transpose"
        reshape = producer(transpose.inputs[0], "Reshape")
        heads4 = transpose.inputs[0]
        if reshape is None or sole_consumer(graph, heads4) is not transpose or heads4.shape is None \
                or len(heads4.shape) != 4 or not all(isinstance(d, int) for d in heads4.shape[2:]):
            return "not the heads of a reshaped projection"
        heads, width = heads4.shape[2], heads4.shape[3]
        if width % 3:
            return "the heads are not [q | k | v] each"
        head_dim = width // 3
        pieces = _thirds(graph, transpose.outputs[0], head_dim)
        if pieces is None:
            return "the heads are not cut into three equal parts of their last axis"
        found = packed_projection(reshape.inputs[0], heads * width)
        if isinstance(found, str):
            return found
        x, weight, bias, name = found
        return InterleavedQkv(x, weight, bias, heads, head_dim, pieces, name)

    def rewrite(self, graph: gs.Graph, match: InterleavedQkv) -> None:
        heads, dim = match.heads, match.head_dim
        # column h·3D + j·D + d of the old layout becomes column j·H·D + h·D + d
        order = (np.arange(heads)[None, :, None] * 3 * dim + np.arange(3)[:, None, None] * dim
                 + np.arange(dim)[None, None, :]).reshape(-1)
        batch = match.x.shape[:2] if match.x.shape is not None and len(match.x.shape) == 3 else [None, None]
        split = [gs.Variable(f"{match.name}_{part}_heads", dtype=match.x.dtype, shape=[*batch, heads, dim])
                 for part in "qkv"]
        write_qkv_blocks(graph, match.name, match.x, match.weight, match.bias, order,
                         [(tensor, heads, dim) for tensor in split])
        for part, (heads4, piece) in enumerate(zip(split, match.pieces)):
            piece.inputs.clear()  # the old Split or Slice gives it up
            graph.nodes.append(gs.Node("Transpose", name=f"{match.name}_{'qkv'[part]}_transpose",
                                       attrs={"perm": [0, 2, 1, 3]}, inputs=[heads4], outputs=[piece]))


def packed_projection(projected: gs.Tensor, columns: int) -> tuple[gs.Tensor, gs.Constant, gs.Constant | None, str] | str:
    """(x, W, b or None, the MatMul's name) of `projected` = x·W (+ b), a [B, S, columns] projection read only
    by what reshapes it into heads; or why not."""
    bias = None
    if projected.shape is None or len(projected.shape) != 3:
        return "the projection is not [B, S, N]"  # the new Reshapes keep its first two dims
    if len(projected.outputs) != 1:
        return "the projection is read elsewhere"
    add = producer(projected, "Add")
    if add is not None:
        constants = [t for t in add.inputs if isinstance(t, gs.Constant)]
        if len(constants) != 1 or constants[0].shape is None or list(constants[0].shape) != [columns]:
            return "the projection's bias is not a constant [N]"
        bias = constants[0]
        projected = next(t for t in add.inputs if not isinstance(t, gs.Constant))
        if len(projected.outputs) != 1:
            return "the projection is read elsewhere"
    matmul = producer(projected, "MatMul")
    if matmul is None or not isinstance(matmul.inputs[1], gs.Constant) or matmul.inputs[1].shape is None \
            or len(matmul.inputs[1].shape) != 2 or matmul.inputs[1].shape[1] != columns:
        return "the projection is not a MatMul against a constant [K, N] weight"
    return matmul.inputs[0], matmul.inputs[1], bias, matmul.name


def write_qkv_blocks(graph: gs.Graph, name: str, x: gs.Tensor, weight: gs.Constant, bias: gs.Constant | None,
                     order: np.ndarray, heads: list[tuple[gs.Tensor, int, int]]) -> gs.Tensor:
    """x · W[:, order] (+ b[order]), the projection with its columns reordered into blocks, cut into `heads`
    (each a [B, S, h, D] tensor, taken from its producer, with its h and D) as Phi-3's packed projection is:
    a Slice of the last axis, then `Reshape([0, 0, h, D])`. Returns the packed projection."""
    dtype = x.dtype
    batch = x.shape[:2] if x.shape is not None and len(x.shape) == 3 else [None, None]
    reordered = gs.Constant(f"{name}_blocks", np.ascontiguousarray(np.asarray(weight.values)[:, order]))
    packed = gs.Variable(f"{name}_blocks_out", dtype=dtype, shape=[*batch, len(order)])
    graph.nodes.append(gs.Node("MatMul", name=f"{name}_blocks", inputs=[x, reordered], outputs=[packed]))
    if bias is not None:
        biased = gs.Variable(f"{name}_blocks_biased", dtype=dtype, shape=packed.shape)
        values = gs.Constant(f"{name}_blocks_bias", np.ascontiguousarray(np.asarray(bias.values)[order]))
        graph.nodes.append(gs.Node("Add", name=f"{name}_blocks_bias", inputs=[packed, values], outputs=[biased]))
        packed = biased
    start = 0
    for part, (tensor, count, dim) in enumerate(heads):
        label = f"{name}_{'qkv'[part]}"
        block = gs.Variable(label, dtype=dtype, shape=[*batch, count * dim])
        tensor.inputs.clear()  # its old producer gives it up
        graph.nodes += [
            gs.Node("Slice", name=label, outputs=[block], inputs=[
                packed, gs.Constant(f"{label}_start", np.array([start], np.int64)),
                gs.Constant(f"{label}_end", np.array([start + count * dim], np.int64)),
                gs.Constant(f"{label}_axis", np.array([-1], np.int64))]),
            gs.Node("Reshape", name=f"{label}_heads", outputs=[tensor], inputs=[
                block, gs.Constant(f"{label}_shape", np.array([0, 0, count, dim], np.int64))])]
        start += count * dim
    return packed
