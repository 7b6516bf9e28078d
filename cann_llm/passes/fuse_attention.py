"""AttentionFusionPass: the whole attention block → cann::FusedAttention.

Anchored at the Softmax; the parts around it are matched by the small matchers of
cann_llm/passes/match_attention.py and cann_llm/passes/match_rotary.py, on the graph LayoutCanonicalizationPass left:

    scores  = MatMul(scale(q), scale(Transpose(k_rep, 0,1,3,2)))       the factors multiply into one scale
    probs   = softmax(scale(scores) [+ mask])                           Casts and sdpa's NaN guard included
    output  = merge(MatMul(probs, v_rep))                               → [B, S, H·D]
    q       = rope?(heads(q_proj))
    k_rep   = repeat?(present_k),  present_k = Concat(past_k, rope?(heads(k_proj))) or the new keys
    v_rep   = repeat?(present_v),  present_v likewise without rope

The mask is kept by meaning, not spelling: the graph input whose values it reads (a 2-D attention_mask)
becomes the fused op's padding mask, a position comparison in its construction makes it causal, and a
position moved back by a constant W before a comparison (or a cache that keeps W - 1 tokens) gives it a
sliding window of W.
The mask subgraph, the KV repetition and the rotations are left without readers and cleaned away.

A model that computes sequence-first (ChatGLM2/3: q, k, v [S, B, H, D], the heads moved to the front by
(1, 2, 0, 3), kᵀ by (1, 2, 3, 0), merged back by (2, 0, 1, 3), its cache [T, B, KV, D] concatenated on axis
0) is read the same way; the fused op is given its inputs moved to [B, S, ...] and its output moved back,
and the cache inputs and outputs take the op's [B, KV, T, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.match_attention import (
    KvCache,
    MaskSource,
    Projection,
    in_float32,
    is_transpose,
    match_gqa_repeat,
    match_head_merge,
    match_head_split,
    mask_alibi,
    match_kv_concat,
    match_mask_source,
    match_probabilities,
    match_scale,
    match_softcap,
    peel_empty_row_guard,
    split_mask,
)
from cann_llm.passes.match_alibi import peel_alibi
from cann_llm.passes.match_rotary import Rotary, match_rotary
from cann_llm.passes.match_sinks import drop_sink_column, peel_sinks
from cann_llm.passes.pattern import FusionPass, fused_node, producer, same_value, sole_consumer
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput, FusedAttentionOutput, input_at, positional


@dataclass
class AttentionMatch:
    query: Projection
    key: Projection
    value: Projection
    past_key: gs.Tensor | None
    past_value: gs.Tensor | None
    present_key: gs.Tensor | None
    present_value: gs.Tensor | None
    mask: gs.Tensor | None
    causal: int
    window: int
    rotary: Rotary | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    output: gs.Tensor
    name: str
    softcap: float = 0.0
    alibi: tuple[float, ...] = ()
    alibi_from_mask: bool = False
    tokens_first: bool = False  # q, k, v, the output and the cache sequence-first ([S, B, ...]), as ChatGLM's
    sinks: tuple[float, ...] = ()  # gpt-oss's logit a head beside its scores (cann_llm/passes/match_sinks.py)
    query_token_scale: gs.Tensor | None = None  # [B, 1, S, 1]: each token's query scaled once rotated (Ministral 3)


# the heads moved to the front of a sequence-first [S, B, H, D]: [B, H, S, D], and kᵀ [B, H, D, S]
_HEADS_OF_TOKENS_FIRST, _KEYS_T_OF_TOKENS_FIRST = [1, 2, 0, 3], [1, 2, 3, 0]


def _token_scaled(tensor: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(the rotated queries, the scale) of [B, H, S, D] queries multiplied once rotated by a factor a token,
    [B, 1, S, 1] (Ministral 3's attention scale by position). A rotation is linear in each
    token's vector, so the factor may as well come before it, where the fused op's rotary takes it."""
    product = producer(tensor, "Mul")
    if product is None:
        return None
    for rotated, factor in (product.inputs, product.inputs[::-1]):
        dims = factor.shape
        if not isinstance(factor, gs.Constant) and dims is not None and len(dims) == 4 and dims[1] == 1 \
                and dims[3] == 1 and match_rotary(rotated) is not None:
            return rotated, factor
    return None


def _transposed_keys(tensor: gs.Tensor) -> tuple[gs.Tensor, float, bool] | None:
    """(the keys, a scale, whether they are sequence-first) of kᵀ: a (0, 1, 3, 2) transpose of [B, H, T, D],
    or (1, 2, 3, 0) of [T, B, H, D], with scalar factors on either side of it."""
    outer, factor = match_scale(tensor)
    transpose = producer(outer, "Transpose")
    tokens_first = is_transpose(transpose, _KEYS_T_OF_TOKENS_FIRST)
    if not (tokens_first or is_transpose(transpose, [0, 1, 3, 2])):
        return None
    keys, inner = match_scale(transpose.inputs[0])
    return keys, factor * inner, tokens_first


def _tokens_first_heads(tensor: gs.Tensor) -> gs.Tensor | None:
    """x [S, B, H, D] when `tensor` is its heads moved to the front, [B, H, S, D]."""
    transpose = producer(tensor, "Transpose")
    return transpose.inputs[0] if is_transpose(transpose, _HEADS_OF_TOKENS_FIRST) else None


def _repeated(tensor: gs.Tensor, tokens_first: bool = False) -> tuple[gs.Tensor, int | None]:
    found = match_gqa_repeat(tensor, tokens_first)
    return found if found is not None else (tensor, 1)


def _cache_owner(keys: gs.Tensor, values: gs.Tensor) -> gs.Node | None:
    """The fused attention whose present keys and values `keys` and `values` are: an earlier layer's, whose
    whole cache this layer attends to."""
    owner = producer(keys, FUSED_ATTENTION.name)
    if owner is None or len(owner.outputs) <= FusedAttentionOutput.PRESENT_VALUE:
        return None
    present = owner.outputs[FusedAttentionOutput.PRESENT_KEY], owner.outputs[FusedAttentionOutput.PRESENT_VALUE]
    return owner if present[0] is keys and present[1] is values else None


def _read_earlier(whole: gs.Tensor, reader: gs.Node, present: gs.Tensor | None, softmax: gs.Node,
                  order: dict[int, int], outputs: set[int]) -> bool:
    """Whether an earlier layer's attention (its softmax before `softmax`, a layer's after the layers it reads)
    reads the whole cache `whole` (past and new keys or values), or what this layer makes of it on the way to
    `reader` (its repetition for the query heads, which an optimiser may compute once for two layers). Shapes,
    the slice a sliding-window layer keeps as its present, and ops an earlier rewrite left dead do not count."""
    own, tensors, tensor = {id(reader)}, [], reader.inputs[1]
    while tensor is not whole:
        node = producer(tensor)
        if node is None or id(node) in own:
            return False
        tensors.append(tensor)
        own.add(id(node))
        tensor = next((t for t in node.inputs if not isinstance(t, gs.Constant) and t.shape is not None
                       and len(t.shape) >= 4), node.inputs[0])
    others = [n for t in (whole, *tensors) for n in t.outputs if id(n) not in own and n.op != "Shape"
              and not (present is not None and present is not whole and any(o is present for o in n.outputs))]
    for other in others:
        found = _downstream(other, outputs)
        if found is not None and found[0] and order.get(id(found[1]), len(order)) < order[id(softmax)]:
            return True
    return False


def _downstream(node: gs.Node, outputs: set[int]) -> tuple[bool, gs.Node] | None:
    """(whether `node` still leads to a graph output, the first Softmax it leads to) or None without one: an
    earlier rewrite in this pass leaves the ops it replaced in the graph, leading nowhere, until its cleanup."""
    seen, todo, alive, first = set(), [node], False, None
    while todo:
        current = todo.pop(0)
        if current.op == "Softmax" and first is None:
            first = current
        for tensor in current.outputs:
            alive = alive or id(tensor) in outputs
            for next_node in tensor.outputs:
                if id(next_node) not in seen:
                    seen.add(id(next_node))
                    todo.append(next_node)
        if alive and first is not None:
            break
    return None if first is None else (alive, first)


def _reused_cache(owner: gs.Node, query4: gs.Tensor, query_rope, tokens_first: bool):
    """(query, rotary, key cache, value cache, key, value) of a layer that attends to `owner`'s cache (Gemma
    3n's last layers reuse the keys and values of the last earlier layer of their kind): it reads the same
    projections, past and rotary tables, so the fused op recomputes the same cache (the paged engine then keeps
    a copy of those pages for this layer). Refused where the tables or the layout differ."""
    if tokens_first:
        return "a sequence-first layer reusing an earlier layer's cache"
    inputs = {slot: input_at(owner.inputs, slot) for slot in FusedAttentionInput}
    if inputs[FusedAttentionInput.KEY] is None or inputs[FusedAttentionInput.PAST_KEY] is None:
        return "the reused cache's keys come packed with its layer's query, or it has no past"
    rotary = None
    if query_rope is not None:
        query4, rotary = query_rope
        if not same_value(rotary.cos, inputs[FusedAttentionInput.COS]) \
                or not same_value(rotary.sin, inputs[FusedAttentionInput.SIN]) \
                or (rotary.rotary_dim, rotary.interleaved) != (owner.attrs.get("rotary_dim", 0),
                                                               owner.attrs.get("rotary_interleaved", 0)):
            return "the query rotates with other tables than the reused cache's keys"
    elif inputs[FusedAttentionInput.COS] is not None:
        return "the reused cache's keys are rotated and the query is not"
    window = owner.attrs.get("sliding_window", 0)
    caches = (KvCache(inputs[slot], inputs[new], None, window) for slot, new in
              ((FusedAttentionInput.PAST_KEY, FusedAttentionInput.KEY),
               (FusedAttentionInput.PAST_VALUE, FusedAttentionInput.VALUE)))
    heads = owner.attrs["kv_num_heads"]
    key, value = (Projection(inputs[slot], heads) for slot in (FusedAttentionInput.KEY, FusedAttentionInput.VALUE))
    return (query4, rotary, *caches, key, value)


class FuseAttention(FusionPass):
    """Fuse scaled-dot-product attention blocks with their projections' head split, RoPE and KV cache."""

    name = "AttentionFusionPass"
    anchor = "Softmax"

    def match(self, graph: gs.Graph, softmax: gs.Node) -> AttentionMatch | str:
        rank = len(softmax.inputs[0].shape or [])
        if softmax.attrs.get("axis", -1) not in (-1, rank - 1) or rank != 4:
            return "not a softmax over the last axis of [B, H, S, T] scores"
        joined, sinks = peel_sinks(softmax.inputs[0])
        logits, masks, outside = split_mask(joined)
        logits, alibi = peel_alibi(logits)
        if alibi is None and len(masks) == 1:
            mask, alibi = mask_alibi(masks[0])
            masks = (mask,)
        capped, softcap = match_softcap(logits)
        if softcap and outside != 1.0:
            return "a scale outside a softcap"
        scores_tensor, scale = match_scale(capped)
        scale *= outside
        scores = producer(scores_tensor, "MatMul")
        if scores is None:
            return "the softmax input is not a (scaled, masked) MatMul"
        query4, query_scale = match_scale(scores.inputs[0])
        keys = _transposed_keys(scores.inputs[1])
        if keys is None:
            return "the keys are not transposed with (0, 1, 3, 2), nor sequence-first with (1, 2, 3, 0)"
        key_rep, key_scale, tokens_first = keys
        scale *= query_scale * key_scale
        probabilities = match_probabilities(graph, softmax)
        if sinks:
            probabilities = drop_sink_column(graph, probabilities)
            if probabilities is None:
                return "the sinks' column is not dropped from the probabilities"
        context = sole_consumer(graph, probabilities, "MatMul")
        if context is None or context.inputs[0] is not probabilities:
            return "the probabilities do not multiply the values"
        value_rep = context.inputs[1]
        if tokens_first:  # the heads moved to the front of [S, B, H, D] q and v as of k
            query4, value_rep = _tokens_first_heads(query4), _tokens_first_heads(value_rep)
            if query4 is None or value_rep is None:
                return "the keys are sequence-first and the query or the values are not"
        output = match_head_merge(graph, peel_empty_row_guard(graph, context.outputs[0], masks), tokens_first)
        if isinstance(output, str):
            return output
        if not in_float32(output):  # an export in float16 runs as exported
            return "the attention does not compute in float32, as the fused op does"

        query_rope = match_rotary(query4)
        token_scale = None
        if query_rope is None and not tokens_first and (scaled := _token_scaled(query4)) is not None:
            query4, token_scale = scaled
            query_rope = match_rotary(query4)
        key_present, key_repeats = _repeated(key_rep, tokens_first)
        value_present, value_repeats = _repeated(value_rep, tokens_first)
        owner = _cache_owner(key_present, value_present)
        if owner is not None:  # the keys and values of an earlier layer, fused already (Gemma 3n's KV sharing)
            if token_scale is not None:
                return "queries scaled a token once rotated, attending to an earlier layer's cache"
            reused = _reused_cache(owner, query4, query_rope, tokens_first)
            if isinstance(reused, str):
                return reused
            query4, rotary, key_cache, value_cache, key, value = reused
        else:
            key_cache = match_kv_concat(graph, key_present, tokens_first)
            key4 = key_cache.new
            key_rope = match_rotary(key4)
            if (query_rope is None) != (key_rope is None):
                return "rotary embedding on only one of q and k"
            rotary = None
            if query_rope is not None:
                (query4, rotary), (key4, key_rotary) = query_rope, key_rope
                if not same_value(key_rotary.cos, rotary.cos) or not same_value(key_rotary.sin, rotary.sin) \
                        or (key_rotary.rotary_dim, key_rotary.interleaved) != (rotary.rotary_dim, rotary.interleaved):
                    return "q and k rotate with different tables"
            value_cache = match_kv_concat(graph, value_present, tokens_first)
            if (key_cache.past is None) != (value_cache.past is None):
                return "a cache for only one of keys and values"
            order = {id(node): index for index, node in enumerate(graph.nodes)}
            outputs = {id(t) for t in graph.outputs}
            if any(cache.past is not None and _read_earlier(whole, reader, cache.present, softmax, order, outputs)
                   for cache, whole, reader in ((key_cache, key_present, scores), (value_cache, value_present, context))):
                # this layer reuses an earlier layer's cache, and that layer's attention did not fuse: taking the
                # cache over would have that layer read the fused op's output
                return "it reuses an earlier layer's cache, whose attention did not fuse"
            if key_cache.window != value_cache.window:
                return f"the key and value caches keep {key_cache.window - 1} and {value_cache.window - 1} tokens"
            key, value = (match_head_split(t, tokens_first) for t in (key4, value_cache.new))
        query = match_head_split(query4, tokens_first)
        for item in (query, key, value):
            if isinstance(item, str):
                return item
        heads, kv_heads, value_heads = query.heads, key.heads, value.heads
        head_dim = query4.shape[-1]
        if kv_heads != value_heads or heads % kv_heads:
            return f"{heads} query heads cannot share {kv_heads} key and {value_heads} value heads"
        if alibi is not None and len(alibi.slopes) != heads:
            return f"ALiBi's term holds {len(alibi.slopes)} slopes for {heads} heads"
        if sinks and len(sinks) != heads:
            return f"{len(sinks)} sinks for {heads} heads"
        if kv_heads == 1:  # one key and value head, broadcast by the MatMuls (Falcon-7B through Optimum)
            key_repeats, value_repeats = (heads if r == 1 else r for r in (key_repeats, value_repeats))
        if any(r is not None and r * kv_heads != heads for r in (key_repeats, value_repeats)):
            return f"the keys and values are repeated {key_repeats} and {value_repeats} times for {heads} heads"
        source = MaskSource(None, 0)
        if masks:
            source = match_mask_source(graph, *masks)
            if isinstance(source, str):
                return source
        if key_cache.past is not None and (refusal := source.refusal_over_a_past()):
            return refusal
        window = source.window or key_cache.window
        if key_cache.window and source.window and key_cache.window != source.window:
            return f"the mask's window ({source.window}) is not the cache's ({key_cache.window})"
        if window and not source.causal:
            return "a sliding window without a causal mask"
        if alibi is not None and alibi.mask is not None and alibi.mask is not source.attention_mask:
            return "ALiBi counts positions over another input than the attention mask"
        if tokens_first:
            if rotary is not None and any(len(t.shape or []) != 4 for t in (rotary.cos, rotary.sin)):
                return "sequence-first rotary tables that are not [S, B, 1, R]"
            for cache in (key_cache, value_cache):
                if cache.present is not None and any(n.op == "Shape" for n in cache.present.outputs):
                    return f"the shape of {cache.present.name} is read, which the fused op's cache layout changes"
                # the fused op keeps its cache [B, KV, T, D]: the input takes that layout, which only its
                # concatenation (which goes) and the Shapes that read it (which are told) may see
                if cache.past is not None and any(n.op not in ("Shape", "Concat") or n.op == "Concat"
                                                  and n.outputs[0] is not cache.present for n in cache.past.outputs):
                    return f"{cache.past.name} is read by more than its cache's concatenation"
                if cache.window:
                    return "a sequence-first cache that keeps a window"
        return AttentionMatch(query, key, value, key_cache.past, value_cache.past, key_cache.present,
                              value_cache.present, source.attention_mask, source.causal, window, rotary, heads,
                              kv_heads, head_dim, scale, output, softmax.name.rsplit("/", 1)[0] + "/" + FUSED_ATTENTION.name,
                              softcap, () if alibi is None else tuple(float(m) * outside for m in alibi.slopes),
                              alibi is not None and alibi.mask is not None, tokens_first, sinks, token_scale)

    def rewrite(self, graph: gs.Graph, match: AttentionMatch) -> None:
        def transposed(tensor: gs.Tensor, perm: list[int], label: str) -> gs.Tensor:
            # a table every layer reads is moved once, by the first layer's rewrite
            done = next((n.outputs[0] for n in tensor.outputs if n.op == "Transpose" and list(n.attrs["perm"]) == perm
                         and n.name.endswith(f"/{label}")), None)
            if done is not None:
                return done
            moved = gs.Variable(f"{match.name}/{tensor.name}_{label}", dtype=tensor.dtype,
                                shape=None if tensor.shape is None else [tensor.shape[i] for i in perm])
            graph.nodes.append(gs.Node("Transpose", name=f"{match.name}/{tensor.name}/{label}", attrs={"perm": perm},
                                       inputs=[tensor], outputs=[moved]))
            return moved

        def flat(projection: Projection) -> gs.Tensor:
            if match.tokens_first:  # [S, B, H·D] to [B, S, H·D]
                return transposed(projection.tensor, [1, 0, 2], "batch_first")
            if not projection.per_head:
                return projection.tensor
            source = projection.tensor
            if projection.heads_first:  # [B, H, S, D] to [B, S, H, D]
                source = transposed(source, [0, 2, 1, 3], "HeadsLast")
            # one per-head value flattened once: its Reshape serves every reader (k and v of one view, or a
            # later layer that reuses this one's keys and values)
            done = next((n.outputs[0] for n in source.outputs if n.op == "Reshape" and n.name == f"{source.name}/MergeHeads"),
                        None)
            if done is not None:
                return done
            shape = None if source.shape is None else list(source.shape[:2]) + [projection.heads * match.head_dim]
            merged = gs.Variable(f"{source.name}_merged", dtype=source.dtype, shape=shape)
            graph.nodes.append(gs.Node("Reshape", name=f"{source.name}/MergeHeads", outputs=[merged], inputs=[
                source, gs.Constant(f"{source.name}_merged_shape", np.array([0, 0, -1], np.int64))]))
            return merged

        rotary = match.rotary
        slot = FusedAttentionInput
        query = flat(match.query)
        if match.query_token_scale is not None:  # [B, 1, S, 1] to [B, S, 1]: a factor on each token's queries
            factor = match.query_token_scale
            tokens = transposed(factor, [0, 2, 1, 3], "TokensFirst")
            flat_factor = gs.Variable(f"{match.name}/query_token_scale", dtype=factor.dtype,
                                      shape=None if tokens.shape is None else list(tokens.shape[:3]))
            graph.nodes.append(gs.Node("Squeeze", name=f"{match.name}/QueryTokenScale", outputs=[flat_factor], inputs=[
                tokens, gs.Constant(f"{match.name}/query_token_scale_axes", np.array([3], np.int64))]))
            scaled = gs.Variable(f"{match.name}/query_scaled", dtype=query.dtype, shape=query.shape)
            graph.nodes.append(gs.Node("Mul", name=f"{match.name}/QueryScaled", inputs=[query, flat_factor],
                                       outputs=[scaled]))
            query = scaled
        cos, sin = (rotary.cos, rotary.sin) if rotary else (None, None)
        if match.tokens_first:
            if rotary:  # tables [S, B, 1, R] to [B, 1, S, R]
                cos, sin = (transposed(t, [1, 2, 0, 3], "batch_first") for t in (cos, sin))
            for past in (match.past_key, match.past_value):
                if past is not None:
                    _take_batch_first(graph, past)
            for present in (match.present_key, match.present_value):
                if present is not None and present.shape is not None:
                    present.shape = [present.shape[i] for i in (1, 2, 0, 3)]
        inputs = positional(slot, {
            slot.QUERY: query, slot.KEY: flat(match.key), slot.VALUE: flat(match.value), slot.PAST_KEY: match.past_key,
            slot.PAST_VALUE: match.past_value, slot.ATTENTION_MASK: match.mask, slot.COS: cos, slot.SIN: sin},
            gs.Variable.empty())
        output = match.output
        if match.tokens_first:  # the op writes [B, S, H·D]; the model goes on with [S, B, H·D]
            output = gs.Variable(f"{match.name}_output", dtype=match.output.dtype,
                                 shape=None if match.output.shape is None else [match.output.shape[i] for i in (1, 0, 2)])
            match.output.inputs.clear()
            graph.nodes.append(gs.Node("Transpose", name=f"{match.name}/TokensFirst", attrs={"perm": [1, 0, 2]},
                                       inputs=[output], outputs=[match.output]))
        elif len(output.shape) == 2:  # rows for a 2-D projection: the op writes [B, S, H·D], a Reshape flattens it
            output = gs.Variable(f"{match.name}_output", dtype=match.output.dtype,
                                 shape=None if query.shape is None else list(query.shape[:2]) + [match.output.shape[-1]])
            match.output.inputs.clear()
            graph.nodes.append(gs.Node("Reshape", name=f"{match.name}/Rows", inputs=[
                output, gs.Constant(f"{match.name}_rows", np.array([-1, match.output.shape[-1]], np.int64))],
                outputs=[match.output]))
        outputs = positional(FusedAttentionOutput, {
            FusedAttentionOutput.OUTPUT: output, FusedAttentionOutput.PRESENT_KEY: match.present_key,
            FusedAttentionOutput.PRESENT_VALUE: match.present_value}, gs.Variable.empty())
        graph.nodes.append(fused_node(
            FUSED_ATTENTION.name, inputs, outputs, match.name, num_heads=match.heads, kv_num_heads=match.kv_heads,
            head_dim=match.head_dim, scale=float(match.scale), causal=match.causal,
            rotary_dim=rotary.rotary_dim if rotary else 0, rotary_interleaved=rotary.interleaved if rotary else 0,
            **({"sliding_window": match.window} if match.window else {}),
            **({"softcap": match.softcap} if match.softcap else {}),
            **({"alibi_slopes": list(match.alibi)} if match.alibi else {}),
            **({"alibi_from_mask": 1} if match.alibi_from_mask else {}),
            **({"sinks": list(match.sinks)} if match.sinks else {})))


def _take_batch_first(graph: gs.Graph, past: gs.Tensor) -> None:
    """A sequence-first cache input [P, B, KV, D] declared [B, KV, P, D], as the fused op keeps it (the
    runtime feeds every cache so); the Shapes that read it are given its old shape's order back."""
    if past.shape is not None:
        past.shape = [past.shape[i] for i in (1, 2, 0, 3)]
    for reader in [n for n in past.outputs if n.op == "Shape"]:
        whole = gs.Variable(f"{reader.name}_batch_first", dtype=np.int64, shape=[4])
        start, end = reader.attrs.get("start", 0), reader.attrs.get("end")
        order = [2, 0, 1, 3][start:end]
        shape = reader.outputs[0]
        reader.outputs.clear()
        reader.outputs.append(whole)
        reader.attrs.pop("start", None)
        reader.attrs.pop("end", None)
        graph.nodes.append(gs.Node("Gather", name=f"{reader.name}/TokensFirstOrder", attrs={"axis": 0},
                                   inputs=[whole, gs.Constant(f"{reader.name}_order", np.array(order, np.int64))],
                                   outputs=[shape]))
