"""AttentionFusionPass: the whole attention block → cann::FusedAttention.

Anchored at the Softmax; from it the matcher walks to the parts an exporter leaves behind:

    scores  = MatMul(q·a, Transpose(k_rep, 0,1,3,2)·b) · c   (scale: any product of scalar Mul/Div)
    probs   = Softmax(scores [+ mask], axis=-1)
    output  = Reshape(Transpose(MatMul(probs, v_rep), 0,2,1,3), [B, S, H·D])
    q       = rope?(Transpose(Reshape(q_proj, [B, S, H, D]), 0,2,1,3))
    k_rep   = repeat?(present_k),  present_k = Concat(past_k, rope?(heads(k_proj)), axis=-2) or the new keys
    v_rep   = repeat?(present_v),  present_v likewise without rope
    repeat  = Reshape(Expand(Unsqueeze(x, 2)))  (GQA/MQA)
    rope(x) = x·cos + Concat(-x[h:R], x[:h])·sin, optionally on x[:R] with x[R:] passed through

The mask is kept by meaning, not spelling: the graph input whose values it reads (a 2-D attention_mask)
becomes the fused op's padding mask, and a position comparison in its construction makes it causal.
The mask subgraph, the KV repetition and the rotations are left without readers and cleaned away.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.pattern import FusionPass, fused_node, producer, scalar, sole_consumer
from runtime.kernels import CUSTOM_DOMAIN

_CAUSAL_OPS = ("LessOrEqual", "GreaterOrEqual", "Less", "Greater", "Trilu")


@dataclass
class Rotary:
    cos: gs.Tensor
    sin: gs.Tensor
    rotary_dim: int
    interleaved: int = 0


@dataclass
class AttentionMatch:
    query: "Projection"
    key: "Projection"
    value: "Projection"
    past_key: gs.Tensor | None
    past_value: gs.Tensor | None
    present_key: gs.Tensor | None
    present_value: gs.Tensor | None
    mask: gs.Tensor | None
    causal: int
    rotary: Rotary | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    output: gs.Tensor
    name: str


def _const_ints(tensor: gs.Tensor) -> list[int] | None:
    if not isinstance(tensor, gs.Constant):
        return None
    return [int(v) for v in np.asarray(tensor.values).reshape(-1)]


def _peel_scale(tensor: gs.Tensor) -> tuple[gs.Tensor, float]:
    """Strip Mul/Div by scalar constants; returns the inner tensor and the product of the factors."""
    factor = 1.0
    while True:
        node = producer(tensor, "Mul", "Div")
        if node is None:
            return tensor, factor
        value = scalar(node.inputs[1])
        if value is not None:
            factor *= value if node.op == "Mul" else 1.0 / value
            tensor = node.inputs[0]
        elif node.op == "Mul" and scalar(node.inputs[0]) is not None:
            factor *= scalar(node.inputs[0])
            tensor = node.inputs[1]
        else:
            return tensor, factor


def _is_transpose(node: gs.Node | None, perm: list[int]) -> bool:
    return node is not None and node.op == "Transpose" and list(node.attrs.get("perm", [])) == perm


def _slice_bounds(node: gs.Node | None, source: gs.Tensor, rank_last: int, step: int = 1) -> tuple[int, int] | None:
    """(start, end) of a Slice of `source` along its last axis with the given step; None otherwise."""
    if node is None or node.op != "Slice" or node.inputs[0] is not source:
        return None
    starts, ends = _const_ints(node.inputs[1]), _const_ints(node.inputs[2])
    axes = _const_ints(node.inputs[3]) if len(node.inputs) > 3 else [rank_last]
    steps = _const_ints(node.inputs[4]) if len(node.inputs) > 4 else [1]
    if None in (starts, ends, axes, steps) or len(starts) != 1 or steps != [step] or axes[0] not in (-1, rank_last):
        return None
    return starts[0], ends[0]


def _half_rotation(turned: gs.Tensor) -> gs.Tensor | None:
    """x when `turned` = Concat(-x[R/2:], x[:R/2]) (NeoX / Llama style)."""
    rotation = producer(turned, "Concat")
    if rotation is None or len(rotation.inputs) != 2 or producer(rotation.inputs[0], "Neg") is None:
        return None
    first_node = producer(rotation.inputs[1], "Slice")
    second_node = producer(producer(rotation.inputs[0], "Neg").inputs[0], "Slice")
    if first_node is None or second_node is None or first_node.inputs[0] is not second_node.inputs[0]:
        return None
    x = first_node.inputs[0]
    if x.shape is None or not isinstance(x.shape[-1], int):
        return None
    width, last = x.shape[-1], len(x.shape) - 1
    bounds = _slice_bounds(second_node, x, last)
    if _slice_bounds(first_node, x, last) != (0, width // 2) or bounds is None or bounds[0] != width // 2 \
            or bounds[1] < width:
        return None
    return x


def _pair_rotation(turned: gs.Tensor) -> gs.Tensor | None:
    """x when `turned` interleaves (-x[1::2], x[0::2]) pairwise (GPT-J / GLM style)."""
    reshape = producer(turned, "Reshape")
    stack = producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if stack is None or len(stack.inputs) != 2:
        return None
    negated, kept = (producer(t, "Unsqueeze") for t in stack.inputs)
    if negated is None or kept is None or producer(negated.inputs[0], "Neg") is None:
        return None
    odd_node = producer(producer(negated.inputs[0], "Neg").inputs[0], "Slice")
    even_node = producer(kept.inputs[0], "Slice")
    if odd_node is None or even_node is None or odd_node.inputs[0] is not even_node.inputs[0]:
        return None
    x = odd_node.inputs[0]
    last = len(x.shape or []) - 1
    odd, even = _slice_bounds(odd_node, x, last, step=2), _slice_bounds(even_node, x, last, step=2)
    if odd is None or even is None or odd[0] != 1 or even[0] != 0:
        return None
    return x


def _rope(tensor: gs.Tensor) -> tuple[gs.Tensor, Rotary] | None:
    """(the un-rotated input, its rotary parameters) if `tensor` is a RoPE output (half or pairwise)."""
    passed_through = None
    concat = producer(tensor, "Concat")
    if concat is not None and len(concat.inputs) == 2 and producer(concat.inputs[1], "Slice") is not None:
        tensor, passed_through = concat.inputs  # partial rotary: [rope(x[:R]), x[R:]]
    add = producer(tensor, "Add")
    if add is None:
        return None
    muls = [producer(t, "Mul") for t in add.inputs]
    if any(m is None for m in muls):
        return None
    for cos_mul, sin_mul in (muls, muls[::-1]):
        for turned_index in (0, 1):
            turned, sin = sin_mul.inputs[turned_index], sin_mul.inputs[1 - turned_index]
            interleaved = 0
            rotated = _half_rotation(turned)
            if rotated is None:
                rotated, interleaved = _pair_rotation(turned), 1
            if rotated is None or not any(t is rotated for t in cos_mul.inputs):
                continue
            width = rotated.shape[-1] if rotated.shape else None
            if not isinstance(width, int):
                continue
            cos = cos_mul.inputs[1] if cos_mul.inputs[0] is rotated else cos_mul.inputs[0]
            source = rotated
            if passed_through is not None:
                head, tail = producer(rotated, "Slice"), producer(passed_through, "Slice")
                if head is None or tail is None or head.inputs[0] is not tail.inputs[0]:
                    return None
                source = head.inputs[0]
                last = len(source.shape or []) - 1
                if _slice_bounds(head, source, last) != (0, width) or (_slice_bounds(tail, source, last) or (0,))[0] != width:
                    return None
            return source, Rotary(cos, sin, width, interleaved)
    return None


@dataclass
class Projection:
    """A [B, S, H·D] input of the fused op; `per_head` is a [B, S, H, D] value to flatten first (the
    output of a per-head q/k RmsNorm, as in Qwen3)."""

    tensor: gs.Tensor
    heads: int
    per_head: bool = False


def _projection(heads4: gs.Tensor) -> Projection | str:
    """From [B, H, S, D] back to the [B, S, H·D] projection it was split from."""
    transpose = producer(heads4, "Transpose")
    if not _is_transpose(transpose, [0, 2, 1, 3]):
        return "the heads are not a (0, 2, 1, 3) transpose"
    split = transpose.inputs[0]
    norm = producer(split, "RmsNorm")
    if norm is not None and norm.domain == CUSTOM_DOMAIN:
        split = norm.inputs[0]
    reshape = producer(split, "Reshape")
    if reshape is None:
        return "the heads are not reshaped from a projection"
    projection = reshape.inputs[0]
    dims = heads4.shape
    if projection.shape is None or len(projection.shape) != 3 or dims is None or not isinstance(dims[-1], int) \
            or not isinstance(projection.shape[-1], int) or projection.shape[-1] % dims[-1]:
        return "the projection's width is not a static multiple of the head size"
    heads = projection.shape[-1] // dims[-1]
    return Projection(norm.outputs[0], heads, True) if norm is not None else Projection(projection, heads)


def _unrepeat(tensor: gs.Tensor) -> gs.Tensor:
    """Undo GQA's Unsqueeze(2) → Expand → Reshape head repetition, if present."""
    reshape = producer(tensor, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsqueeze is None:
        return tensor
    axes = unsqueeze.attrs.get("axes") or _const_ints(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 \
        else unsqueeze.attrs.get("axes")
    return unsqueeze.inputs[0] if list(axes or []) == [2] else tensor


def _cache(graph: gs.Graph, present: gs.Tensor) -> tuple[gs.Tensor | None, gs.Tensor, gs.Tensor | None]:
    """(past, new, present-to-take-over) for a KV tensor that may be Concat(past, new) on the sequence axis."""
    concat = producer(present, "Concat")
    if concat is not None and len(concat.inputs) == 2 and concat.attrs.get("axis") in (-2, 2) \
            and any(t is concat.inputs[0] for t in graph.inputs):
        return concat.inputs[0], concat.inputs[1], present
    return None, present, None


def _mask_source(graph: gs.Graph, mask: gs.Tensor) -> tuple[gs.Tensor | None, int] | str:
    """The graph input whose values the mask reads (values behind a Shape do not count), and causality."""
    readers: dict[int, gs.Tensor] = {}
    causal, seen, queue = 0, set(), deque([mask])
    inputs = {id(t): t for t in graph.inputs}
    while queue:
        tensor = queue.popleft()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if id(tensor) in inputs:
            readers[id(tensor)] = tensor
            continue
        node = producer(tensor)
        if node is None or node.op == "Shape":
            continue
        causal |= node.op in _CAUSAL_OPS
        queue.extend(node.inputs)
    candidates = [t for t in readers.values() if t.shape is not None and len(t.shape) == 2
                  and np.dtype(t.dtype).kind in "iub"]
    if len(candidates) > 1:
        return f"the mask reads several inputs ({', '.join(t.name for t in candidates)})"
    if not candidates and not causal:
        return "the mask reads no 2-D integer input and compares no positions"
    return (candidates[0] if candidates else None), int(causal)


class FuseAttention(FusionPass):
    """Fuse scaled-dot-product attention blocks with their projections' head split, RoPE and KV cache."""

    name = "AttentionFusionPass"
    anchor = "Softmax"

    def match(self, graph: gs.Graph, softmax: gs.Node) -> AttentionMatch | str:
        rank = len(softmax.inputs[0].shape or [])
        if softmax.attrs.get("axis", -1) not in (-1, rank - 1) or rank != 4:
            return "not a softmax over the last axis of [B, H, S, T] scores"
        logits, mask = softmax.inputs[0], None
        add = producer(logits, "Add")
        if add is not None:
            for scored, candidate in (add.inputs, add.inputs[::-1]):
                if producer(_peel_scale(scored)[0], "MatMul") is not None and not isinstance(candidate, gs.Constant):
                    logits, mask = scored, candidate
                    break
        scores_tensor, scale = _peel_scale(logits)
        scores = producer(scores_tensor, "MatMul")
        if scores is None:
            return "the softmax input is not a (scaled, masked) MatMul"
        query4, query_scale = _peel_scale(scores.inputs[0])
        key_t, key_scale = _peel_scale(scores.inputs[1])
        scale *= query_scale * key_scale
        transpose = producer(key_t, "Transpose")
        if not _is_transpose(transpose, [0, 1, 3, 2]):
            return "the keys are not transposed with (0, 1, 3, 2)"
        context = sole_consumer(graph, softmax.outputs[0], "MatMul")
        if context is None or context.inputs[0] is not softmax.outputs[0]:
            return "the probabilities do not multiply the values"
        merge = sole_consumer(graph, context.outputs[0], "Transpose")
        reshape = sole_consumer(graph, merge.outputs[0], "Reshape") if _is_transpose(merge, [0, 2, 1, 3]) else None
        if reshape is None or reshape.outputs[0].shape is None or len(reshape.outputs[0].shape) != 3:
            return "the context is not merged back to [B, S, H·D]"

        query_rope = _rope(query4)
        past_key, key4, present_key = _cache(graph, _unrepeat(transpose.inputs[0]))
        key_rope = _rope(key4)
        if (query_rope is None) != (key_rope is None):
            return "rotary embedding on only one of q and k"
        rotary = None
        if query_rope is not None:
            (query4, rotary), (key4, key_rotary) = query_rope, key_rope
            if key_rotary.cos is not rotary.cos or key_rotary.sin is not rotary.sin \
                    or (key_rotary.rotary_dim, key_rotary.interleaved) != (rotary.rotary_dim, rotary.interleaved):
                return "q and k rotate with different tables"
        past_value, value4, present_value = _cache(graph, _unrepeat(context.inputs[1]))
        if (past_key is None) != (past_value is None):
            return "a cache for only one of keys and values"
        found = [_projection(t) for t in (query4, key4, value4)]
        for item in found:
            if isinstance(item, str):
                return item
        query, key, value = found
        heads, kv_heads, value_heads = query.heads, key.heads, value.heads
        head_dim = query4.shape[-1]
        if kv_heads != value_heads or heads % kv_heads:
            return f"{heads} query heads cannot share {kv_heads} key and {value_heads} value heads"
        mask_input, causal = None, 0
        if mask is not None:
            source = _mask_source(graph, mask)
            if isinstance(source, str):
                return source
            mask_input, causal = source
        return AttentionMatch(query, key, value, past_key, past_value, present_key, present_value, mask_input,
                              causal, rotary, heads, kv_heads, head_dim, scale, reshape.outputs[0],
                              softmax.name.rsplit("/", 1)[0] + "/FusedAttention")

    def rewrite(self, graph: gs.Graph, match: AttentionMatch) -> None:
        def optional(tensor):
            return tensor if tensor is not None else gs.Variable.empty()

        def flat(projection: Projection) -> gs.Tensor:
            if not projection.per_head:
                return projection.tensor
            source = projection.tensor
            shape = None if source.shape is None else list(source.shape[:2]) + [projection.heads * match.head_dim]
            merged = gs.Variable(f"{source.name}_merged", dtype=source.dtype, shape=shape)
            graph.nodes.append(gs.Node("Reshape", name=f"{source.name}/MergeHeads", outputs=[merged], inputs=[
                source, gs.Constant(f"{source.name}_merged_shape", np.array([0, 0, -1], np.int64))]))
            return merged

        rotary = match.rotary
        inputs = [flat(match.query), flat(match.key), flat(match.value), optional(match.past_key), optional(match.past_value),
                  optional(match.mask), optional(rotary and rotary.cos), optional(rotary and rotary.sin)]
        while inputs and inputs[-1].name == "":
            inputs.pop()
        outputs = [match.output] + [t for t in (match.present_key, match.present_value) if t is not None]
        graph.nodes.append(fused_node(
            "FusedAttention", inputs, outputs, match.name, num_heads=match.heads, kv_num_heads=match.kv_heads,
            head_dim=match.head_dim, scale=float(match.scale), causal=match.causal,
            rotary_dim=rotary.rotary_dim if rotary else 0, rotary_interleaved=rotary.interleaved if rotary else 0))
