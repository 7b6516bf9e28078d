"""FusedAttention's cos/sin inputs from the half-width caches rotary ops take, and the node builder the
conversion passes share.

onnx's RotaryEmbedding (opset 23), onnxruntime's RotaryEmbedding and GroupQueryAttention hold
`cos_cache`/`sin_cache` [max_position, R/2] read at each token's position; FusedAttention takes the
full-width tables [B, 1, S, R] of the tokens at hand (docs/ops.md), which `rotary_tables` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import numpy as np
import onnx_graphsurgeon as gs


class NodeBuilder:
    """Appends standard-op nodes to `graph`, each output named under `prefix`."""

    def __init__(self, graph: gs.Graph, prefix: str):
        self.graph, self.prefix, self._counter = graph, prefix, count()

    def __call__(self, op: str, inputs: list[gs.Tensor], attrs: dict | None = None, output: gs.Tensor | None = None,
                 dtype=None) -> gs.Tensor:
        out = output or gs.Variable(f"{self.prefix}/{op}_{next(self._counter)}", dtype=dtype)
        self.graph.nodes.append(gs.Node(op, name=f"{out.name}/node", attrs=attrs or {}, inputs=inputs, outputs=[out]))
        return out

    def const(self, values, dtype=np.int64) -> gs.Constant:
        return gs.Constant(f"{self.prefix}/const_{next(self._counter)}", np.asarray(values, dtype=dtype))


@dataclass
class Rotation:
    """A rotation as a rotary op states it: half-width caches, where to read them, R and the pairing.

    `positions` is None when the caches are already the tokens' own rows ([B, S, R/2]); `offset` marks a
    one-element `positions` that is the first token's position (onnxruntime's RotaryEmbedding), the others
    following it one by one.
    """

    cos_cache: gs.Tensor
    sin_cache: gs.Tensor
    positions: gs.Tensor | None
    rotary_dim: int
    interleaved: int
    offset: bool = False

    def key(self) -> tuple:
        """Equal for rotations by equal tables: the same tensors, or tensors computed alike (onnxscript's
        opset-23 fusion computes `Cos(freqs)` once for q and once more for k)."""
        return (computation(self.cos_cache), computation(self.sin_cache), computation(self.positions),
                self.rotary_dim, self.interleaved, self.offset)

    def same_as(self, other: "Rotation") -> bool:
        return self.key() == other.key()


def paired_rotation(rotated_q, rotated_k):
    """Given what a rotary matcher found on q and on k ((source, Rotation) or None each): (q, k, the shared
    Rotation or None), or why the pair is refused. Both rotate with one table, or neither rotates."""
    if rotated_q is None and rotated_k is None:
        return None
    if rotated_q is None or rotated_k is None:
        return "rotary embedding on only one of q and k"
    (q, rotation), (k, key_rotation) = rotated_q, rotated_k
    if not key_rotation.same_as(rotation):
        return "q and k rotate with different tables"
    return q, k, rotation


def computation(tensor: gs.Tensor | None) -> tuple:
    """A key equal for tensors computed by the same op, attributes and inputs (or for the same tensor)."""
    node = tensor.inputs[0] if tensor is not None and not isinstance(tensor, gs.Constant) and tensor.inputs else None
    if node is None or len(node.outputs) != 1:
        return ("tensor", id(tensor))
    return (node.op, node.domain, tuple(id(t) for t in node.inputs), repr(sorted(node.attrs.items())))


def offset_positions(b: NodeBuilder, offset: gs.Tensor, x: gs.Tensor, seq_axis: int = 1) -> gs.Tensor:
    """[1, S] positions offset, offset + 1, ... for the S tokens of x (on `seq_axis`)."""
    start = b("Reshape", [b("Cast", [offset], {"to": 7}, dtype=np.int64), b.const([])], dtype=np.int64)
    # Gather, not Shape's start and end (opset 15): the graph keeps its opset, 14 included
    length = b("Gather", [b("Shape", [x], dtype=np.int64), b.const(seq_axis)], {"axis": 0}, dtype=np.int64)
    steps = b("Range", [b.const(0), length, b.const(1)], dtype=np.int64)
    return b("Unsqueeze", [b("Add", [steps, start], dtype=np.int64), b.const([0])], dtype=np.int64)


def rotary_tables(b: NodeBuilder, rotation: Rotation, x: gs.Tensor, seq_axis: int = 1) -> tuple[gs.Tensor, gs.Tensor]:
    """FusedAttention's cos and sin [B|1, 1, S, R] for the tokens of x (on `seq_axis`)."""
    positions = rotation.positions
    if positions is not None and rotation.offset:
        positions = offset_positions(b, positions, x, seq_axis)
    tables = []
    for cache in (rotation.cos_cache, rotation.sin_cache):
        half = b("Gather", [cache, positions], {"axis": 0}, dtype=cache.dtype) if positions is not None else cache
        if rotation.interleaved:
            pair = b("Unsqueeze", [half, b.const([-1])], dtype=cache.dtype)
            pairs = b("Concat", [pair, pair], {"axis": -1}, dtype=cache.dtype)
            full = b("Reshape", [pairs, b.const([0, 0, -1])], dtype=cache.dtype)
        else:
            full = b("Concat", [half, half], {"axis": -1}, dtype=cache.dtype)
        tables.append(b("Unsqueeze", [full, b.const([1])], dtype=cache.dtype))
    return tables[0], tables[1]


def spell_rotation(b: NodeBuilder, x: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor, rotary_dim: int, interleaved: int,
                   output: gs.Tensor | None = None) -> gs.Tensor:
    """`x·cos + turn(x)·sin` over x's first `rotary_dim` of its last axis (the rest passed through), in the
    standard ops cann_llm/passes/match_rotary.py reads back: halves turned (`[-x2, x1]`), or pairs when `interleaved`.
    x is 4-D with a static last axis; the tables broadcast to x's rotated part."""
    head_dim, width = x.shape[-1], rotary_dim

    def part(source: gs.Tensor, start: int, end: int, step: int = 1) -> gs.Tensor:
        sliced = b("Slice", [source, b.const([start]), b.const([end]), b.const([-1]), b.const([step])], dtype=x.dtype)
        sliced.shape = list(x.shape[:-1]) + [len(range(start, end, step))]
        return sliced

    rotated = part(x, 0, width) if width < head_dim else x
    if interleaved:
        pair = [b("Unsqueeze", [b("Neg", [part(rotated, 1, width, 2)], dtype=x.dtype), b.const([-1])], dtype=x.dtype),
                b("Unsqueeze", [part(rotated, 0, width, 2), b.const([-1])], dtype=x.dtype)]
        turned = b("Reshape", [b("Concat", pair, {"axis": -1}, dtype=x.dtype), b.const([0, 0, 0, width])], dtype=x.dtype)
    else:
        half = width // 2
        turned = b("Concat", [b("Neg", [part(rotated, half, width)], dtype=x.dtype), part(rotated, 0, half)],
                   {"axis": -1}, dtype=x.dtype)
    products = [b("Mul", [rotated, cos], dtype=x.dtype), b("Mul", [turned, sin], dtype=x.dtype)]
    if width == head_dim:
        return b("Add", products, output=output)
    rope = b("Add", products, dtype=x.dtype)
    rope.shape = list(x.shape[:-1]) + [width]
    return b("Concat", [rope, part(x, width, head_dim)], {"axis": -1}, output=output)
