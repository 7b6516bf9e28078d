"""SplitRotaryCanonicalizationPass: a rotation written on the two halves of each head, as gpt-oss writes it, in
the spelling match_rotary reads.

    x1, x2 = chunk(x, 2, -1)                          c, s: tables of R/2 angles
    out    = cat([x1·c − x2·s, x2·c + x1·s], -1)
  → out    = x·cos + cat([−x[R/2:], x[:R/2]], -1)·sin   cos = cat([c, c]), sin = cat([s, s])

The same rotation value for value (Llama's rotate_half, whose tables repeat each angle for both halves).
The halves may be a Split or two Slices of x; the products and sums in either order. One doubled table is
made for each table q and k share.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import CanonicalNodes, replace_all_uses, rewrite_each
from cann_llm.passes.match_rotary import halves
from cann_llm.passes.pattern import producer

_BIG = 2**31 - 1


def _product(tensor: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    mul = producer(tensor, "Mul")
    return (mul.inputs[0], mul.inputs[1]) if mul is not None and len(mul.inputs) == 2 else None


class CanonicalizeSplitRotary:
    """gpt-oss's rotation of the halves → x·cos + rotate_half(x)·sin."""

    name = "SplitRotaryCanonicalizationPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        tables: dict[int, gs.Tensor] = {}  # a half table's id → its doubled table
        candidates = [n for n in graph.nodes if n.op == "Concat" and len(n.inputs) == 2]
        return rewrite_each(graph, candidates, self._match,
                            lambda concat, *found: self._rewrite(graph, concat, *found, tables))

    @staticmethod
    def _match(concat: gs.Node) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor] | None:
        """(x, c, s) of the pattern ending at `concat`, or None."""
        out = concat.outputs[0]
        rank = len(out.shape or [])
        if rank < 2 or concat.attrs.get("axis") not in (-1, rank - 1):
            return None
        sub, add = producer(concat.inputs[0], "Sub"), producer(concat.inputs[1], "Add")
        if sub is None or add is None:
            return None
        products = [_product(t) for t in (*sub.inputs, *add.inputs)]
        if any(p is None for p in products):
            return None
        # x1·c − x2·s: the first product's half is x1; find which factor is which from the two halves
        for x1_index in (0, 1):
            x1, c = products[0][x1_index], products[0][1 - x1_index]
            for x2_index in (0, 1):
                x2, s = products[1][x2_index], products[1][1 - x2_index]
                x = halves(x1, x2)
                if x is None or x.shape is None or list(out.shape or []) != list(x.shape) \
                        or not isinstance(x.shape[-1], int) \
                        or any(t.shape is None or len(t.shape) == 0 or t.shape[-1] != x.shape[-1] // 2 for t in (c, s)):
                    continue  # the doubled tables must be x's width
                # x2·c + x1·s, in either order of the sum and of each product
                wanted = [{id(x2), id(c)}, {id(x1), id(s)}]
                got = [{id(t) for t in p} for p in products[2:]]
                if got == wanted or got == wanted[::-1]:
                    return x, c, s
        return None

    @staticmethod
    def _rewrite(graph: gs.Graph, concat: gs.Node, x: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor,
                 tables: dict[int, gs.Tensor]) -> None:
        width, b = x.shape[-1], CanonicalNodes(concat.name, x.dtype)

        def doubled(half: gs.Tensor) -> gs.Tensor:
            if id(half) not in tables:
                shape = None if half.shape is None else [*half.shape[:-1], width]
                table = gs.Variable(f"{half.name}_doubled", dtype=half.dtype, shape=shape)
                graph.nodes.append(gs.Node("Concat", f"{half.name}/Doubled", {"axis": -1}, [half, half], [table]))
                tables[id(half)] = table
            return tables[id(half)]

        last = b.const("last", [-1])
        first = b.node("Slice", [x, b.const("zero", [0]), b.const("half", [width // 2]), last])
        second = b.node("Slice", [x, b.const("half_start", [width // 2]), b.const("end", [_BIG]), last])
        turned = b.node("Concat", [b.node("Neg", [second]), first], {"axis": -1})
        rotated = b.node("Add", [b.node("Mul", [x, doubled(cos)]), b.node("Mul", [turned, doubled(sin)])],
                         shape=list(x.shape))
        b.done(graph)
        replace_all_uses(graph, concat.outputs[0], rotated)
