"""GroupedQkvSplitPass: q, k and v cut from one projection by regrouping its heads, reordered into blocks.

Falcon-40B/180B (`new_decoder_architecture`) and InternLM2's `wqkv` pack q, k and v by KV group: the
projection's columns run group by group, each group's query heads then its key and its value, and the
exporters write `Reshape([B, S, Hkv, G+2, D])`, a Slice of the first G on the group axis (reshaped to
[B, S, H, D]) and two Gathers for the key and the value. Falcon-7B's multi-query projection is cut by a Split
of its head axis; Baichuan's `W_pack` by moving its three parts to a leading axis (Unsqueeze, Transpose,
Squeeze) and Gathers there. None is the spelling AttentionFusionPass reads (Llama's, or Phi-3's Slices of a
packed projection). The pass follows the per-token ops from the projection to the three [B, S, h, D] tensors
the head transposes read, tracking which projection column each element holds (and where the batch and
sequence axes are), then permutes the weight's columns (and the bias) so each tensor is one contiguous
block: `Slice` then `Reshape([0, 0, h, D])`. The same values, the weights reordered once at compile time;
QkvFusionPass then feeds the packed projection to the attention whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, axes_of, const_ints, is_graph_output, producer
from cann_llm.passes.shape_values import is_dim, reshape_target
from cann_llm.passes.split_interleaved_qkv import write_qkv_blocks

_HEAD_TRANSPOSE = [0, 2, 1, 3]


@dataclass
class Cut:
    """A tensor cut from the projection: `cols[i]` is the projection column its element i holds, over its
    feature axes; its batch and sequence axes (`tokens`, in that order) have size 1 in `cols`."""

    tensor: gs.Tensor
    cols: np.ndarray
    tokens: tuple[int, int]


@dataclass
class GroupedQkv:
    x: gs.Tensor
    weight: gs.Constant
    bias: gs.Constant | None
    pieces: list[Cut]  # the [B, S, h, D] tensors the head transposes read
    shapes: list[tuple[gs.Node, Cut]]  # Shape ops on the way (TorchScript's flatten) and what they read
    name: str


def _keeps_tokens(node: gs.Node) -> bool:
    """A Reshape that leaves the batch and sequence axes first as they are and regroups each token's features."""
    source, result = node.inputs[0].shape, node.outputs[0].shape
    if source is None or result is None or len(source) < 2 or len(result) < 3 \
            or not all(isinstance(d, int) for d in [*source[2:], *result[2:]]) \
            or np.prod(source[2:], dtype=np.int64) != np.prod(result[2:], dtype=np.int64):
        return False
    target = reshape_target(node)
    for axis, (before, after) in enumerate(zip(source[:2], result[:2])):
        other = source[1 - axis]
        if target is not None and not isinstance(target[axis], int) and is_dim(target[axis], node.inputs[0], 1 - axis):
            return False  # the token axes swapped
        # shape inference shows the same axis as an equal number, or as symbols it may name differently on
        # each side (dynamo's exports compute the target from other inputs' dims): never a number for a
        # symbol, nor the other token axis's symbol
        if before != after and (isinstance(before, int) or isinstance(after, int) or after == other):
            return False
    return True


def _same_static_shape(a: gs.Tensor, b: gs.Tensor) -> bool:
    """Both inferred, of one rank, equal wherever a dim is a number and numbers nowhere else."""
    return a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape) and all(
        x == y if isinstance(x, int) or isinstance(y, int) else True for x, y in zip(a.shape, b.shape))


def _axis(axis: int, rank: int, cut: Cut) -> int | None:
    """`axis` (negative counting from the end) when it is one of `cut`'s feature axes."""
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank and axis not in cut.tokens else None


def _fits(cut: Cut) -> bool:
    """Whether the columns tracked agree with the tensor's inferred shape wherever it is a number."""
    shape = cut.tensor.shape
    return shape is None or len(shape) == cut.cols.ndim and all(
        not isinstance(dim, int) or axis in cut.tokens or dim == size
        for axis, (dim, size) in enumerate(zip(shape, cut.cols.shape)))


def _through(node: gs.Node, cut: Cut) -> list[Cut] | None:
    """What `node` (reading `cut` as its data input) cuts from it, when it works within each token's
    features and every piece agrees with its inferred shape; None otherwise."""
    try:
        cuts = _cuts(node, cut)
    except (IndexError, ValueError):  # constant indices or axes out of range: not a graph to rewrite
        return None
    return cuts if cuts is not None and all(_fits(c) for c in cuts) else None


def _cuts(node: gs.Node, cut: Cut) -> list[Cut] | None:
    cols, rank, out = cut.cols, cut.cols.ndim, node.outputs
    if node.op == "Identity" or node.op == "Expand" and _same_static_shape(node.inputs[0], out[0]):
        return [Cut(out[0], cols, cut.tokens)]  # Falcon's broadcast_to of one key head a group: no copy
    if node.op == "Reshape":
        if cut.tokens != (0, 1) or not _keeps_tokens(node):
            return None
        return [Cut(out[0], cols.reshape((1, 1, *out[0].shape[2:])), cut.tokens)]
    if node.op == "Transpose":
        perm = list(node.attrs.get("perm", reversed(range(rank))))
        return [Cut(out[0], np.transpose(cols, perm), (perm.index(cut.tokens[0]), perm.index(cut.tokens[1])))]
    if node.op == "Slice":
        starts, ends, axes = (const_ints(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2, 3))
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1] * len(starts or [])
        # ONNX clamps a backward Slice's start otherwise than Python does: forward steps only
        if None in (starts, ends, axes, steps) or min(steps, default=0) < 1:
            return None
        index = [slice(None)] * rank
        for start, end, axis, step in zip(starts, ends, axes, steps):
            if _axis(axis, rank, cut) is None:
                return None
            index[_axis(axis, rank, cut)] = slice(start, end, step)  # clamped as ONNX clamps it
        return [Cut(out[0], cols[tuple(index)], cut.tokens)]
    if node.op == "Gather":
        axis, indices = _axis(node.attrs.get("axis", 0), rank, cut), node.inputs[1]
        if axis is None or not isinstance(indices, gs.Constant):
            return None
        indices = np.asarray(indices.values)
        tokens = tuple(t if t < axis else t + indices.ndim - 1 for t in cut.tokens)
        return [Cut(out[0], np.take(cols, indices, axis=axis), tokens)]
    if node.op == "Split":
        axis = _axis(node.attrs.get("axis", 0), rank, cut)
        given = len(node.inputs) > 1 and node.inputs[1].name  # an empty name: no input
        sizes = const_ints(node.inputs[1]) if given else node.attrs.get("split")
        if axis is None or given and sizes is None:  # sizes computed at run time
            return None
        if sizes is None:
            if cols.shape[axis] % len(out):
                return None
            sizes = [cols.shape[axis] // len(out)] * len(out)
        if len(sizes) != len(out) or sum(sizes) != cols.shape[axis]:
            return None
        return [Cut(t, part, cut.tokens) for t, part in zip(out, np.split(cols, np.cumsum(sizes)[:-1], axis=axis))]
    if node.op in ("Squeeze", "Unsqueeze"):
        axes = axes_of(node)
        if not axes:  # a Squeeze of every size-1 axis could take a token axis of length 1 too
            return None
        if node.op == "Squeeze":
            axes = [_axis(a, rank, cut) for a in axes]
            if None in axes or any(cols.shape[a] != 1 for a in axes):
                return None
            tokens = tuple(t - sum(a < t for a in axes) for t in cut.tokens)
            return [Cut(out[0], np.squeeze(cols, tuple(axes)), tokens)]
        added = sorted(a + rank + len(axes) if a < 0 else a for a in axes)
        kept = [a for a in range(rank + len(axes)) if a not in added]  # where each old axis goes
        return [Cut(out[0], np.expand_dims(cols, tuple(added)), (kept[cut.tokens[0]], kept[cut.tokens[1]]))]
    return None


def _heads(graph: gs.Graph, packed: gs.Tensor, width: int) -> tuple[list[Cut], list[tuple[gs.Node, Cut]]] | str:
    """The [B, S, h, D] tensors that per-token ops cut from `packed` ([B, S, width]) for the head transposes
    to read, and the Shape ops reading what is cut on the way; a reason when anything else reads it."""
    heads, shapes, pending = [], [], [Cut(packed, np.arange(width).reshape(1, 1, width), (0, 1))]
    while pending:
        cut = pending.pop()
        readers = cut.tensor.outputs
        if is_graph_output(graph, cut.tensor) or not readers:
            return "a piece of the projection leaves the graph or is unused"
        transposes = [r for r in readers if r.op == "Transpose" and list(r.attrs.get("perm", [])) == _HEAD_TRANSPOSE]
        # a head tensor may also be measured (TorchScript's later reshapes read its Shape): the Shape goes on
        # reading it once it is cut from the new blocks
        if cut.cols.ndim == 4 and cut.tokens == (0, 1) and transposes \
                and all(r in transposes or r.op == "Shape" for r in readers):
            heads.append(cut)
            continue
        for node in readers:
            if node.op == "Shape":
                shapes.append((node, cut))
                continue
            step = _through(node, cut) if node.inputs[0] is cut.tensor else None
            if step is None:
                return f"{node.op} {node.name} does not cut heads from the projection"
            pending += step
    return heads, shapes


def _already_blocks(heads: list[Cut], packed: gs.Tensor) -> bool:
    """Each piece is Reshape(Slice(packed)): the spelling the attention fusion reads already."""
    for head in heads:
        reshape = producer(head.tensor, "Reshape")
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
        if len(heads) != 3 or len({head.cols.shape[3] for head in heads}) != 1:
            return "not three pieces of heads of one size"
        if sorted(np.concatenate([head.cols.reshape(-1) for head in heads]).tolist()) != list(range(width)):
            return "the pieces do not take each column once"
        if _already_blocks(heads, packed):
            return "already cut into blocks"
        # q, k, v in the spellings known, queries first: a wrong guess would only keep QkvFusionPass from
        # taking the projection whole (the attention fusion tells q, k and v apart by the graph)
        heads.sort(key=lambda head: int(head.cols.min()))
        return GroupedQkv(matmul.inputs[0], weight, bias, heads, shapes, matmul.name)

    def rewrite(self, graph: gs.Graph, match: GroupedQkv) -> None:
        order = np.concatenate([piece.cols.reshape(-1) for piece in match.pieces])
        packed = write_qkv_blocks(graph, match.name, match.x, match.weight, match.bias, order,
                                  [(piece.tensor, *piece.cols.shape[2:]) for piece in match.pieces])
        for index, (node, read) in enumerate(match.shapes):
            _shape_from(graph, node, packed, read, f"{match.name}_shape{index}")


def _shape_from(graph: gs.Graph, node: gs.Node, packed: gs.Tensor, read: Cut, label: str) -> None:
    """`node` (a Shape of a tensor cut from the old projection) computed from `packed` instead: the batch and
    sequence lengths where that tensor has them, the dims of its features (constants) between."""
    result = node.outputs[0]
    result.inputs.clear()
    dims = gs.Variable(f"{label}_packed", dtype=np.int64, shape=[3])
    graph.nodes.append(gs.Node("Shape", name=f"{label}_packed", inputs=[packed], outputs=[dims]))
    parts = []
    for axis, size in enumerate(read.cols.shape):
        part = f"{label}_{axis}"
        if axis in read.tokens:  # Gather, not Shape's start and end: those need opset 15
            parts.append(gs.Variable(part, dtype=np.int64, shape=[1]))
            graph.nodes.append(gs.Node("Gather", name=part, attrs={"axis": 0}, outputs=[parts[-1]], inputs=[
                dims, gs.Constant(f"{part}_index", np.array([read.tokens.index(axis)], np.int64))]))
        else:
            parts.append(gs.Constant(part, np.array([size], np.int64)))
    start, end = node.attrs.get("start", 0), node.attrs.get("end")
    whole = start == 0 and end is None
    full = result if whole else gs.Variable(f"{label}_full", dtype=np.int64, shape=[len(parts)])
    graph.nodes.append(gs.Node("Concat", name=f"{label}_full", attrs={"axis": 0}, inputs=parts, outputs=[full]))
    if not whole:
        ends = [end if end is not None else np.iinfo(np.int64).max]
        graph.nodes.append(gs.Node("Slice", name=label, outputs=[result], inputs=[
            full, gs.Constant(f"{label}_start", np.array([start], np.int64)),
            gs.Constant(f"{label}_end", np.array(ends, np.int64))]))
