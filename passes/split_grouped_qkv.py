"""GroupedQkvSplitPass: q, k and v cut from one projection by regrouping its heads, reordered into blocks.

Falcon-40B/180B (`new_decoder_architecture`) and InternLM2's `wqkv` pack q, k and v by KV group: the
projection's columns run group by group, each group's query heads then its key and its value, and the
exporters write `Reshape([B, S, Hkv, G+2, D])`, a Slice of the first G on the group axis (reshaped to
[B, S, H, D]) and two Gathers for the key and the value. Falcon-7B's multi-query projection is cut by a Split
of its head axis. Neither is the spelling AttentionFusionPass reads (Llama's, or Phi-3's Slices of a
packed projection). The pass follows the per-token ops from the projection to the three [B, S, h, D] tensors
the head transposes read, tracking which projection column each element holds, then permutes the weight's
columns (and the bias) so each tensor is one contiguous block: `Slice` then `Reshape([0, 0, h, D])`. The same
values, the weights reordered once at compile time; QkvFusionPass then feeds the packed projection to the
attention whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.pattern import FusionPass, const_ints, is_graph_output, producer

_HEAD_TRANSPOSE = [0, 2, 1, 3]


@dataclass
class GroupedQkv:
    x: gs.Tensor
    weight: gs.Constant
    bias: gs.Constant | None
    pieces: list[tuple[gs.Tensor, np.ndarray]]  # each [B, S, h, D] tensor and the columns it holds, [h, D]
    shapes: list[tuple[gs.Node, tuple[int, ...]]]  # Shape ops on the way (TorchScript's flatten), each
    name: str                                      # with the per-token dims of the tensor it reads


def _keeps_tokens(node: gs.Node) -> bool:
    """A Reshape that leaves the batch and sequence axes as they are and regroups each token's features."""
    source, result = node.inputs[0].shape, node.outputs[0].shape
    if source is None or result is None or len(source) < 2 or len(result) < 3 \
            or not all(isinstance(d, int) for d in [*source[2:], *result[2:]]) \
            or np.prod(source[2:], dtype=np.int64) != np.prod(result[2:], dtype=np.int64):
        return False
    # the features of a token stay together; the two token axes are the same ones, which shape inference
    # shows as equal numbers, or as symbols it may name differently on each side (never a number for a symbol)
    return all(a == b or not isinstance(a, int) and not isinstance(b, int) for a, b in zip(source[:2], result[:2]))


def _feature_axis(axis: int, rank: int) -> int | None:
    """`axis` of a [B, S, ...] tensor as an axis of its per-token columns, or None for B and S."""
    axis = axis + rank if axis < 0 else axis
    return axis - 2 if 2 <= axis < rank else None


def _through(node: gs.Node, cols: np.ndarray) -> list[tuple[gs.Tensor, np.ndarray]] | None:
    """Each output of `node` with the columns its elements hold, when `node` works within each token
    (reading `cols`' tensor as its data input); None otherwise."""
    rank = cols.ndim + 2
    if node.op == "Identity":
        return [(node.outputs[0], cols)]
    if node.op == "Reshape":
        if not _keeps_tokens(node):
            return None
        return [(node.outputs[0], cols.reshape(node.outputs[0].shape[2:]))]
    if node.op == "Slice":
        starts, ends, axes = (const_ints(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2, 3))
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1] * len(starts or [])
        if None in (starts, ends, axes, steps):
            return None
        cut = [slice(None)] * cols.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps):
            feature = _feature_axis(axis, rank)
            if feature is None:
                return None
            cut[feature] = slice(start, end, step)  # ONNX clamps as Python does
        return [(node.outputs[0], cols[tuple(cut)])]
    if node.op == "Gather":
        feature, indices = _feature_axis(node.attrs.get("axis", 0), rank), node.inputs[1]
        if feature is None or not isinstance(indices, gs.Constant):
            return None
        return [(node.outputs[0], np.take(cols, np.asarray(indices.values), axis=feature))]
    if node.op == "Split":
        feature = _feature_axis(node.attrs.get("axis", 0), rank)
        sizes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else node.attrs.get("split")
        if feature is None:
            return None
        if sizes is None:
            if cols.shape[feature] % len(node.outputs):
                return None
            sizes = [cols.shape[feature] // len(node.outputs)] * len(node.outputs)
        if len(sizes) != len(node.outputs) or sum(sizes) != cols.shape[feature]:
            return None
        return list(zip(node.outputs, np.split(cols, np.cumsum(sizes)[:-1], axis=feature)))
    if node.op in ("Squeeze", "Unsqueeze"):
        axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else node.attrs.get("axes")
        out_rank = rank - len(axes or []) if node.op == "Squeeze" else rank + len(axes or [])
        features = [_feature_axis(a, rank if node.op == "Squeeze" else out_rank) for a in axes or []]
        if not axes or None in features:
            return None
        reshaped = np.squeeze(cols, tuple(features)) if node.op == "Squeeze" else np.expand_dims(cols, tuple(features))
        return [(node.outputs[0], reshaped)]
    return None


def _heads(graph: gs.Graph, packed: gs.Tensor, width: int) -> tuple[list, list] | str:
    """The [B, S, h, D] tensors that per-token ops cut from `packed` ([B, S, width]) for the head transposes
    to read, each with the columns of `packed` it holds, and the Shape ops reading what is cut on the way;
    a reason when anything else reads it."""
    heads, shapes, pending = [], [], [(packed, np.arange(width))]
    while pending:
        tensor, cols = pending.pop()
        readers = tensor.outputs
        if is_graph_output(graph, tensor) or not readers:
            return "a piece of the projection leaves the graph or is unused"
        if cols.ndim == 2 and all(r.op == "Transpose" and list(r.attrs.get("perm", [])) == _HEAD_TRANSPOSE
                                  for r in readers):
            heads.append((tensor, cols))
            continue
        for node in readers:
            if node.op == "Shape":
                shapes.append((node, cols.shape))
                continue
            step = _through(node, cols) if node.inputs[0] is tensor else None
            if step is None:
                return f"{node.op} {node.name} does not cut heads from the projection"
            pending += step
    return heads, shapes


def _already_blocks(heads: list[tuple[gs.Tensor, np.ndarray]], packed: gs.Tensor) -> bool:
    """Each piece is Reshape(Slice(packed)): the spelling the attention fusion reads already."""
    for tensor, _ in heads:
        reshape = producer(tensor, "Reshape")
        if reshape is None or producer(reshape.inputs[0], "Slice") is None \
                or producer(reshape.inputs[0]).inputs[0] is not packed:
            return False
    return True


class SplitGroupedQkv(FusionPass):
    """Reorder a projection whose q, k and v heads are cut by regrouping per token into [q | k | v] blocks."""

    name = "GroupedQkvSplitPass"
    anchor = "MatMul"

    def match(self, graph: gs.Graph, matmul: gs.Node) -> GroupedQkv | str:
        weight = matmul.inputs[1]
        if not isinstance(weight, gs.Constant) or weight.shape is None or len(weight.shape) != 2:
            return "not a MatMul against a constant 2-D weight"
        width, packed, bias = weight.shape[1], matmul.outputs[0], None
        if packed.shape is None or len(packed.shape) != 3:
            return "the projection is not [B, S, N]"  # the new Reshapes keep its first two dims
        add = packed.outputs[0] if len(packed.outputs) == 1 and not is_graph_output(graph, packed) else None
        if add is not None and add.op == "Add":
            constants = [t for t in add.inputs if isinstance(t, gs.Constant)]
            if len(constants) == 1 and constants[0].shape is not None and list(constants[0].shape) == [width]:
                bias, packed = constants[0], add.outputs[0]
        found = _heads(graph, packed, width)
        if isinstance(found, str):
            return found
        heads, shapes = found
        if len(heads) != 3 or len({cols.shape[1] for _, cols in heads}) != 1:
            return "not three pieces of heads of one size"
        if sorted(np.concatenate([cols.reshape(-1) for _, cols in heads]).tolist()) != list(range(width)):
            return "the pieces do not take each column once"
        if _already_blocks(heads, packed):
            return "already cut into blocks"
        heads.sort(key=lambda piece: int(piece[1].min()))  # q, k, v in the spellings known: queries lead
        return GroupedQkv(matmul.inputs[0], weight, bias, heads, shapes, matmul.name)

    def rewrite(self, graph: gs.Graph, match: GroupedQkv) -> None:
        order = np.concatenate([cols.reshape(-1) for _, cols in match.pieces])
        name, dtype = match.name, match.x.dtype
        batch = match.x.shape[:2] if match.x.shape is not None and len(match.x.shape) == 3 else [None, None]
        weight = gs.Constant(f"{name}_blocks", np.ascontiguousarray(np.asarray(match.weight.values)[:, order]))
        packed = gs.Variable(f"{name}_blocks_out", dtype=dtype, shape=[*batch, len(order)])
        graph.nodes.append(gs.Node("MatMul", name=f"{name}_blocks", inputs=[match.x, weight], outputs=[packed]))
        if match.bias is not None:
            biased = gs.Variable(f"{name}_blocks_biased", dtype=dtype, shape=packed.shape)
            bias = gs.Constant(f"{name}_blocks_bias", np.ascontiguousarray(np.asarray(match.bias.values)[order]))
            graph.nodes.append(gs.Node("Add", name=f"{name}_blocks_bias", inputs=[packed, bias], outputs=[biased]))
            packed = biased
        start = 0
        for part, (piece, cols) in enumerate(match.pieces):
            heads, dim = cols.shape
            label = f"{name}_{'qkv'[part]}"
            block = gs.Variable(label, dtype=dtype, shape=[*batch, heads * dim])
            piece.inputs.clear()  # its old producer gives it up
            graph.nodes += [
                gs.Node("Slice", name=label, outputs=[block], inputs=[
                    packed, gs.Constant(f"{label}_start", np.array([start], np.int64)),
                    gs.Constant(f"{label}_end", np.array([start + heads * dim], np.int64)),
                    gs.Constant(f"{label}_axis", np.array([-1], np.int64))]),
                gs.Node("Reshape", name=f"{label}_heads", outputs=[piece], inputs=[
                    block, gs.Constant(f"{label}_shape", np.array([0, 0, heads, dim], np.int64))])]
            start += heads * dim
        for index, (node, features) in enumerate(match.shapes):
            _shape_from(graph, node, packed, features, f"{name}_shape{index}")


def _shape_from(graph: gs.Graph, node: gs.Node, packed: gs.Tensor, features: tuple[int, ...], label: str) -> None:
    """`node` (a Shape of a tensor cut from the old projection) computed from `packed` instead: its batch and
    sequence lengths, then the features' dims, which are constants."""
    result = node.outputs[0]
    result.inputs.clear()
    start, end = node.attrs.get("start", 0), node.attrs.get("end")
    whole = start == 0 and end is None
    tokens = gs.Variable(f"{label}_tokens", dtype=np.int64, shape=[2])
    full = result if whole else gs.Variable(f"{label}_full", dtype=np.int64, shape=[2 + len(features)])
    graph.nodes += [
        gs.Node("Shape", name=f"{label}_tokens", attrs={"start": 0, "end": 2}, inputs=[packed], outputs=[tokens]),
        gs.Node("Concat", name=f"{label}_full", attrs={"axis": 0}, outputs=[full],
                inputs=[tokens, gs.Constant(f"{label}_features", np.array(features, np.int64))])]
    if not whole:
        ends = [end if end is not None else np.iinfo(np.int64).max]
        graph.nodes.append(gs.Node("Slice", name=label, outputs=[result], inputs=[
            full, gs.Constant(f"{label}_start", np.array([start], np.int64)),
            gs.Constant(f"{label}_end", np.array(ends, np.int64))]))
