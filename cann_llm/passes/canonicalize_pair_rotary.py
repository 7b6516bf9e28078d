"""PairRotaryCanonicalizationPass: a rotation of neighbouring pairs computed on a view of them, as ChatGLM2's
and ChatGLM3's remote code writes it, in the spelling match_rotary reads.

    xs   = Reshape(x[..., :R], [..., R/2, 2])          rc = the (cos, sin) pairs, [..., R/2, 2]
    out  = Reshape(stack([xs0·c − xs1·s, xs1·c + xs0·s], -1), [..., R])     xs_i = xs[..., i], c = rc[..., 0], s = rc[..., 1]
  → out  = x[..., :R]·cos + turn(x[..., :R])·sin       cos, sin = c, s with each value twice (pairs)

`turn` is GPT-J's interleaving of (−x[1::2], x[0::2]), the same rotation value for value: the tables only
repeat each angle's cosine and sine for the two members of its pair. Only where every piece is the one
the pattern names, the halves of one view and of one table, with the view's leading axes the input's.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import CanonicalNodes, replace_all_uses, rewrite_each
from cann_llm.passes.pattern import axes_of, const_ints, producer, scalar


def _last_axis(node: gs.Node, rank: int) -> bool:
    return node.attrs.get("axis", 0) in (-1, rank - 1)


def _half(tensor: gs.Tensor) -> tuple[gs.Tensor, int] | None:
    """(v, i) when `tensor` is v[..., i] of a view v whose last axis holds a pair (i in 0, 1)."""
    gather = producer(tensor, "Gather")
    if gather is None:
        return None
    source, index = gather.inputs[0], scalar(gather.inputs[1])
    if source.shape is None or source.shape[-1] != 2 or not _last_axis(gather, len(source.shape)) \
            or index not in (0, 1) or len(gather.inputs[1].shape or []) != 0:
        return None
    return source, int(index)


def _stacked(tensor: gs.Tensor) -> gs.Tensor | None:
    """x when `tensor` is Unsqueeze(x) along a new last axis."""
    node = producer(tensor, "Unsqueeze")
    if node is None or tensor.shape is None or axes_of(node) not in ([-1], [len(tensor.shape) - 1]):
        return None
    return node.inputs[0]


def _table_source(half: gs.Tensor) -> tuple[gs.Tensor, int, int] | None:
    """(T, i, u) when `half` is the i-th of the pairs of a table T [..., R/2, 2], all of whose rows a Slice
    keeps, viewed with a unit axis inserted at u for the heads: ChatGLM3's `rope_cache[:sq].view(sq, -1, 1,
    R/2, 2)[..., i]` (T [S, B, R/2, 2], u 2) and GLM-4's `rope_cache[:, :sq].view(-1, 1, sq, R/2, 2)[..., i]`
    (T [B, S, R/2, 2], u 1), which q and k each view anew; read from T, the two rotations read one table."""
    gather = producer(half, "Gather")
    view = producer(gather.inputs[0], "Reshape") if gather is not None else None
    rows = producer(view.inputs[0], "Slice") if view is not None else None
    if rows is None or const_ints(rows.inputs[1]) != [0] or len(rows.inputs) < 4:
        return None
    table, viewed, cut, axes = rows.inputs[0], gather.inputs[0].shape, rows.outputs[0].shape, const_ints(rows.inputs[3])
    if table.shape is None or viewed is None or cut is None or axes is None or len(axes) != 1 \
            or len(viewed) != len(table.shape) + 1:
        return None
    axis = axes[0] % len(table.shape)
    # the slice keeps every row only where both counts are the same dim
    if cut[axis] is None or cut[axis] != table.shape[axis]:
        return None
    unit = next((u for u in range(len(viewed) - 2) if viewed[u] == 1
                 and list(viewed[:u]) + list(viewed[u + 1:]) == list(table.shape)), None)
    return None if unit is None else (table, int(scalar(gather.inputs[1])), unit)


class CanonicalizePairRotary:
    """ChatGLM's pair rotation → x·cos + turn(x)·sin."""

    name = "PairRotaryCanonicalizationPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        tables: list[tuple[tuple[gs.Tensor, int, int] | None, gs.Tensor]] = []  # (its source, a doubled table)
        return rewrite_each(graph, [n for n in graph.nodes if n.op == "Reshape"], self._match,
                            lambda flatten, *found: self._rewrite(graph, flatten, *found, tables))

    @staticmethod
    def _match(flatten: gs.Node) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor] | None:
        """(x[..., :R], c, s) of the pattern ending at `flatten`, or None."""
        stack, out = producer(flatten.inputs[0], "Concat"), flatten.outputs[0]
        if stack is None or len(stack.inputs) != 2 or out.shape is None or not isinstance(out.shape[-1], int) \
                or stack.outputs[0].shape is None or not _last_axis(stack, len(stack.outputs[0].shape)):
            return None
        width = out.shape[-1]
        first, second = (_stacked(t) for t in stack.inputs)
        sub = producer(first, "Sub") if first is not None else None
        add = producer(second, "Add") if second is not None else None
        if sub is None or add is None:
            return None
        products = [producer(t, "Mul") for t in (*sub.inputs, *add.inputs)]
        if any(product is None for product in products):
            return None
        factors = [[(_half(t), t) for t in product.inputs] for product in products]
        if any(half is None for pair in factors for half, _ in pair):
            return None
        # a complex product reads alike either way round: the view is the one cut from a head's R dims
        sources = {id(half[0]): half[0] for pair in factors for half, _ in pair}
        views = [t for t in sources.values() if (cut := producer(t, "Reshape")) is not None
                 and cut.inputs[0].shape is not None and cut.inputs[0].shape[-1] == width]
        if len(sources) != 2 or len(views) != 1:
            return None
        view = views[0]
        ordered = [sorted(pair, key=lambda factor: factor[0][0] is not view) for pair in factors]
        if any(pair[0][0][0] is not view or pair[1][0][0] is view for pair in ordered):
            return None
        indices = [(pair[0][0][1], pair[1][0][1]) for pair in ordered]
        # xs0·c − xs1·s, and xs1·c + xs0·s in either order
        if indices[:2] != [(0, 0), (1, 1)] or sorted(indices[2:]) != [(0, 1), (1, 0)]:
            return None
        cos = {id(pair[1][1]): pair[1][1] for pair in ordered if pair[1][0][1] == 0}
        sin = {id(pair[1][1]): pair[1][1] for pair in ordered if pair[1][0][1] == 1}
        x = producer(view, "Reshape").inputs[0]
        if len(cos) != 1 or len(sin) != 1 or view.shape is None or len(view.shape) != len(x.shape) + 1 \
                or view.shape[-2] != width // 2 or list(view.shape[:-2]) != list(x.shape[:-1]) \
                or list(out.shape) != list(x.shape):  # the pairs flattened back to x's own shape
            return None
        cos, sin = next(iter(cos.values())), next(iter(sin.values()))
        if cos.shape is None or sin.shape is None:  # the doubled tables are reshaped by rank
            return None
        return x, cos, sin

    @staticmethod
    def _rewrite(graph: gs.Graph, flatten: gs.Node, x: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor,
                 tables: list[tuple[tuple[gs.Tensor, int, int] | None, gs.Tensor]]) -> None:
        width, b = x.shape[-1], CanonicalNodes(flatten.name, x.dtype)

        last = b.const("last", [-1])

        def doubled(half: gs.Tensor) -> gs.Tensor:
            # each angle's value for both members of its pair
            # q's and k's halves are cut from two views of one table: the fusion asks for one table
            source = _table_source(half)
            known = next((table for seen, table in tables if source is not None and seen == source), None)
            if known is not None:
                return known
            if source is not None:  # the view's own values: T's i-th halves with a unit axis for the heads
                table_of_pairs, index, unit = source
                picked = b.node("Gather", [table_of_pairs, b.const(f"half_{index}", index)], {"axis": -1})
                half = b.node("Unsqueeze", [picked, b.const(f"heads_{index}", [unit])], shape=list(half.shape))
            column = b.node("Unsqueeze", [half, last])
            table = b.node("Reshape", [b.node("Concat", [column, column], {"axis": -1}),
                                       b.const(f"pairs_{half.name}", [0] * (len(half.shape) - 1) + [width])],
                           shape=[*half.shape[:-1], width])
            tables.append((source, table))
            return table

        odd = b.node("Slice", [x, b.const("one", [1]), b.const("width", [width]), last, b.const("two", [2])])
        even = b.node("Slice", [x, b.const("zero", [0]), b.const("width_even", [width]), last,
                                b.const("two_even", [2])])
        pairs = b.node("Concat", [b.node("Unsqueeze", [b.node("Neg", [odd]), last]),
                                  b.node("Unsqueeze", [even, last])], {"axis": -1})
        turned = b.node("Reshape", [pairs, b.const("turned", [0] * (len(x.shape) - 1) + [width])])
        rotated = b.node("Add", [b.node("Mul", [x, doubled(cos)]), b.node("Mul", [turned, doubled(sin)])],
                         shape=list(flatten.outputs[0].shape))
        b.done(graph)
        replace_all_uses(graph, flatten.outputs[0], rotated)
