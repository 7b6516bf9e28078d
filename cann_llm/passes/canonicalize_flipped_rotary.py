"""FlippedRotaryCanonicalizationPass: a rotation whose rotate_half turns the other way, as nanochat writes it,
in the spelling match_rotary reads.

    out = x·cos + cat([x[R/2:], −x[:R/2]], -1)·sin
  → out = x·cos + cat([−x[R/2:], x[:R/2]], -1)·(−sin)

The same rotation value for value: the turned halves are Llama's negated, so the sine is. One negated table is
made for each table q and k share, so they still rotate with one table.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import CanonicalNodes, replace_all_uses, rewrite_each
from cann_llm.passes.match_rotary import halves
from cann_llm.passes.pattern import producer


def flipped_halves(turned: gs.Tensor) -> gs.Tensor | None:
    """x when `turned` = Concat(x[R/2:], −x[:R/2]) on the last axis (x's width R)."""
    concat = producer(turned, "Concat")
    rank = len(turned.shape or [])
    if concat is None or len(concat.inputs) != 2 or concat.attrs.get("axis") not in (-1, rank - 1):
        return None
    negated = producer(concat.inputs[1], "Neg")
    return halves(negated.inputs[0], concat.inputs[0]) if negated is not None else None


class CanonicalizeFlippedRotary:
    """nanochat's rotate_half the other way round → Llama's, with the sine negated."""

    name = "FlippedRotaryCanonicalizationPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        tables: dict[int, gs.Tensor] = {}  # a sine table's id → its negation
        candidates = [n for n in graph.nodes if n.op == "Mul" and len(n.inputs) == 2]
        return rewrite_each(graph, candidates, self._match,
                            lambda mul, *found: self._rewrite(graph, mul, *found, tables))

    @staticmethod
    def _match(mul: gs.Node) -> tuple[gs.Tensor, gs.Tensor] | None:
        """(x, sin) where `mul` multiplies x's flipped halves by a table, and x·cos is added to it."""
        for turned, sin in (mul.inputs, mul.inputs[::-1]):
            x = flipped_halves(turned)
            if x is None:
                continue
            add = next((n for n in mul.outputs[0].outputs if n.op == "Add"), None)
            other = None if add is None else next((t for t in add.inputs if t is not mul.outputs[0]), None)
            cos = producer(other, "Mul") if other is not None else None
            if cos is not None and any(t is x for t in cos.inputs):
                return x, sin
        return None

    @staticmethod
    def _rewrite(graph: gs.Graph, mul: gs.Node, x: gs.Tensor, sin: gs.Tensor, tables: dict[int, gs.Tensor]) -> None:
        width, b = x.shape[-1], CanonicalNodes(mul.name, x.dtype)
        if id(sin) not in tables:
            negated = gs.Variable(f"{sin.name}_negated", dtype=sin.dtype, shape=sin.shape)
            graph.nodes.append(gs.Node("Neg", f"{sin.name}/Negated", {}, [sin], [negated]))
            tables[id(sin)] = negated
        last = b.const("last", [-1])
        first = b.node("Slice", [x, b.const("zero", [0]), b.const("half", [width // 2]), last])
        second = b.node("Slice", [x, b.const("half_start", [width // 2]), b.const("end", [2**31 - 1]), last])
        turned = b.node("Concat", [b.node("Neg", [second]), first], {"axis": -1})
        product = b.node("Mul", [turned, tables[id(sin)]], shape=mul.outputs[0].shape)
        b.done(graph)
        replace_all_uses(graph, mul.outputs[0], product)
