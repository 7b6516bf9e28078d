"""BatchedHeadsPass: attention multiplied on heads folded into the batch ([B·H, S, D] MatMuls, BLOOM's) → the
same products on [B, H, S, D], the spelling AttentionFusionPass reads.

BLOOM views q, k and v from [B, H, ·, D] as [B·H, ·, D], multiplies (`baddbmm` adds ALiBi's [B·H, 1, T] term
to the scaled scores), views the scores as [B, H, S, T] for the mask and the softmax, then the
probabilities back as [B·H, S, T] for the values, and the context as [B, H, S, D]. Two rules, each exact:

- scores: `Reshape([B, H, S, T])(f(MatMul(Reshape(q), Transpose(Reshape(k), 0, 2, 1))))`, f elementwise
  (scalar factors, casts, terms of [B·H, 1|S, T] or shared [1, ·, ·]) → f on `MatMul(q, Transpose(k, 0, 1,
  3, 2))`, each [B·H, ·, ·] term viewed as [B, H, ·, ·];
- context: `Reshape([B, H, S, D])(MatMul(Reshape(p), Reshape(v)))` → `MatMul(p, v)`.

Folding [B, H] into B·H and unfolding B·H into [B, H] are inverse when the unfold's second dim is H; every
fold and unfold must keep the last two axes whole: both proven (from the Reshape's target, or from inferred
dims that carry one name), or one of them once the leading axes are proven to be B·H (the count of elements
then fixes the other). TorchScript reads the folded context's Shape for the merge's target; that target
becomes [0, 0, H·D], so nothing reads the folded products any more.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses, tidy
from cann_llm.passes.pattern import producer, scalar, sole_consumer
from cann_llm.passes.rotary_tables import NodeBuilder
from cann_llm.passes.shape_values import DimOf, is_dim, reshape_target, shape_elements

_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


def _named(dim) -> bool:
    return isinstance(dim, int) or (isinstance(dim, str) and not dim.startswith("unk__"))


def _same_dim(element, tensor: gs.Tensor, axis: int) -> bool:
    """Whether a Reshape target's element is dim `axis` of `tensor`: proven on the shape chain, or the two
    inferred dims carry one name."""
    if is_dim(element, tensor, axis):
        return True
    mine = tensor.shape[axis] if tensor.shape is not None else None
    if isinstance(element, DimOf) and element.tensor.shape is not None and _named(mine):
        return element.tensor.shape[element.axis] == mine
    return False


def _target_tail(reshape: gs.Node) -> list | None:
    """The last two elements of a Reshape's target: from the whole target when it can be read, else from the
    last parts of the Concat that builds it (TorchScript's `B·H` is a Mul the chain cannot read)."""
    target = reshape_target(reshape)
    if target is not None:
        return target[-2:]
    concat = producer(reshape.inputs[1], "Concat")
    tail: list = []
    for part in reversed(concat.inputs if concat is not None and concat.attrs.get("axis", 0) in (0, -1) else []):
        elements = shape_elements(part)
        if elements is None:
            return None
        tail = elements + tail
        if len(tail) >= 2:
            return None if 0 in tail[-2:] else tail[-2:]  # a 0 copies an input dim its position names
    return None


def _dim_kept(reshape: gs.Node, source: gs.Tensor, from_end: int) -> bool:
    """Whether the Reshape's dim `from_end` places from the end is source's dim as many places from its end."""
    tail, result = _target_tail(reshape), reshape.outputs[0].shape
    if tail is not None and _same_dim(tail[-from_end], source, len(source.shape) - from_end):
        return True
    return _named(result[-from_end]) and result[-from_end] == source.shape[-from_end]


def _product(whole, first, second) -> bool:
    """Whether dim `whole` is known to be `first`·`second` (numbers, or the names inference gives products)."""
    if all(isinstance(d, int) for d in (whole, first, second)):
        return whole == first * second
    return isinstance(whole, str) and _named(first) and _named(second) and whole in (f"{first}*{second}",
                                                                                      f"{second}*{first}")


def _keeps_trailing(reshape: gs.Node, source: gs.Tensor, rank: int, leading: bool) -> bool:
    """Whether `reshape` views `source` as `rank` axes whose last two are source's last two: both proven, or
    one of them when the leading axes are known to hold as many elements (`leading`): the count of elements
    then fixes the other."""
    result = reshape.outputs[0].shape
    if result is None or len(result) != rank:
        return False
    last, before = _dim_kept(reshape, source, 1), _dim_kept(reshape, source, 2)
    return last and before or leading and (last or before)


def _folded(tensor: gs.Tensor) -> gs.Tensor | None:
    """x of `Reshape(x)` folding a 4-D x's first two axes into one, its last two kept whole."""
    reshape = producer(tensor, "Reshape")
    if reshape is None:
        return None
    source, result = reshape.inputs[0], reshape.outputs[0].shape
    if source.shape is None or len(source.shape) != 4 or result is None or len(result) != 3:
        return None
    leading = _product(result[0], source.shape[0], source.shape[1])
    return source if _keeps_trailing(reshape, source, 3, leading) else None


def _unfolds(reshape: gs.Node, heads: int) -> bool:
    """Whether `reshape` views a [B·H, ·, ·] tensor as [B, H, ·, ·] with the same last two axes."""
    source, result = reshape.inputs[0], reshape.outputs[0].shape
    if source.shape is None or len(source.shape) != 3 or result is None or len(result) != 4:
        return False
    target = reshape_target(reshape)
    second = target[1] if target is not None and len(target) == 4 else result[1]
    leading = _product(source.shape[0], result[0], heads)
    return second == heads and _keeps_trailing(reshape, source, 4, leading)


def _heads(query: gs.Tensor, key: gs.Tensor) -> int | None:
    heads = query.shape[1]
    return heads if isinstance(heads, int) and key.shape[1] == heads else None


def _chain_to(tensor: gs.Tensor, op: str, depth: int = 8) -> list[tuple[gs.Node, int]] | None:
    """The elementwise nodes from `tensor` back to a node of type `op` (each with the index of the operand
    that leads there), outermost first; None when there is no such path."""
    node = producer(tensor)
    if node is None or depth == 0:
        return None
    if node.op == op:
        return []
    if node.op == "Cast":
        inner = _chain_to(node.inputs[0], op, depth - 1)
        return None if inner is None else [(node, 0)] + inner
    if node.op in _ELEMENTWISE:
        for index in (0, 1):
            inner = _chain_to(node.inputs[index], op, depth - 1)
            if inner is not None:
                return [(node, index)] + inner
    return None


def _unfold_term(build: NodeBuilder, term: gs.Tensor, query: gs.Tensor) -> gs.Tensor | None:
    """A scalar, or a [1, ·, ·] term shared by every head of every row, as it is; a [B·H, ·, ·] term viewed as
    [B, H, ·, ·]; None for anything else."""
    if scalar(term) is not None or term.shape is not None and len(term.shape) <= 2:
        return term
    if term.shape is None or len(term.shape) != 3:
        return None
    if term.shape[0] == 1:
        return term
    heads = query.shape[1]
    if not _product(term.shape[0], query.shape[0], heads):
        return None
    trailing = build("Slice", [build("Shape", [term]), build.const([1]), build.const([3])])
    return build("Reshape", [term, build("Concat", [build.const([-1, heads]), trailing], {"axis": 0})])


def _refold(graph: gs.Graph, build: NodeBuilder, old: gs.Tensor, result: gs.Tensor) -> None:
    """Whatever else read the folded tensor `old` (TorchScript reads its Shape for the next view) reads
    `result` folded again, so the folded products lose their last reader."""
    if any(consumer.outputs for consumer in old.outputs):
        trailing = build("Slice", [build("Shape", [result]), build.const([2]), build.const([4])])
        refolded = build("Reshape", [result, build("Concat", [build.const([-1]), trailing], {"axis": 0})])
        replace_all_uses(graph, old, refolded)


def unfold_scores(graph: gs.Graph, reshape: gs.Node) -> bool:
    """The scores rule of the module's docstring, anchored at the unfolding Reshape."""
    chain = _chain_to(reshape.inputs[0], "MatMul")
    if chain is None:
        return False
    matmul = producer(chain[-1][0].inputs[chain[-1][1]] if chain else reshape.inputs[0], "MatMul")
    keys_t = producer(matmul.inputs[1], "Transpose")
    if keys_t is None or list(keys_t.attrs.get("perm", [])) != [0, 2, 1]:
        return False
    query, key = _folded(matmul.inputs[0]), _folded(keys_t.inputs[0])
    heads = _heads(query, key) if query is not None and key is not None else None
    if heads is None or not _unfolds(reshape, heads):
        return False
    build = NodeBuilder(graph, f"{reshape.name}/Unfolded")
    terms = {}
    for node, index in chain:
        if node.op != "Cast":
            terms[id(node)] = _unfold_term(build, node.inputs[1 - index], query)
            if terms[id(node)] is None:
                return False  # what was built for the terms reads nothing kept: the cleanup drops it
    result = reshape.outputs[0]
    reshape.outputs.clear()
    keys = build("Transpose", [key], {"perm": [0, 1, 3, 2]})
    current = build("MatMul", [query, keys], output=None if chain else result)
    for position, (node, index) in enumerate(reversed(chain)):
        output = result if position == len(chain) - 1 else None
        if node.op == "Cast":
            current = build("Cast", [current], dict(node.attrs), output=output)
        else:
            term = terms[id(node)]
            current = build(node.op, [current, term] if index == 0 else [term, current], output=output)
    _refold(graph, build, reshape.inputs[0], result)
    return True


def unfold_context(graph: gs.Graph, reshape: gs.Node) -> bool:
    """The context rule of the module's docstring, anchored at the unfolding Reshape."""
    matmul = producer(reshape.inputs[0], "MatMul")
    if matmul is None:
        return False
    probabilities, values = _folded(matmul.inputs[0]), _folded(matmul.inputs[1])
    heads = _heads(probabilities, values) if probabilities is not None and values is not None else None
    if heads is None or not _unfolds(reshape, heads):
        return False
    result = reshape.outputs[0]
    reshape.outputs.clear()
    NodeBuilder(graph, f"{reshape.name}/Unfolded")("MatMul", [probabilities, values], output=result)
    if any(consumer.outputs for consumer in matmul.outputs[0].outputs) and isinstance(values.shape[-1], int):
        _merge_without_the_fold(graph, result, heads * values.shape[-1])
    return True


def _merge_without_the_fold(graph: gs.Graph, context: gs.Tensor, width: int) -> None:
    """TorchScript computes the merge's target [B, S, H·D] from the folded context's Shape: that target
    becomes [0, 0, H·D] (B and S copied from the transposed context), and the fold loses its last reader."""
    transpose = sole_consumer(graph, context, "Transpose")
    if transpose is None or list(transpose.attrs.get("perm", [])) != [0, 2, 1, 3]:
        return
    for reader in transpose.outputs[0].outputs:
        merged = reader.outputs[0].shape if reader.op == "Reshape" else None
        if merged is not None and len(merged) == 3 and merged[-1] == width and not reader.attrs.get("allowzero", 0):
            reader.inputs[1] = gs.Constant(f"{reader.name}/merged_shape", np.array([0, 0, width], np.int64))


class UnfoldBatchedHeads:
    """Apply both rules wherever they hold."""

    name = "BatchedHeadsPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for reshape in [n for n in graph.nodes if n.op == "Reshape"]:
            if reshape.outputs and (unfold_scores(graph, reshape) or unfold_context(graph, reshape)):
                result.match_times += 1
                result.effect_times += 1
        tidy(graph)
        return result
