"""AttentionConversionPass: ONNX's own Attention (opset 23), with the RotaryEmbedding (opset 23) nodes that
rotate its query and key, → cann::FusedAttention.

The forms FusedAttention expresses are taken: 3-D [B, S, H·D] or 4-D [B, H, S, D] q/k/v (4-D ones are
flattened by a Transpose + Reshape, and the output turned back); an attn_mask of shape [B|1, H|1, S, T],
boolean or additive, becomes FusedAttention's explicit bias input; is_causal with the bottom-right
alignment the op uses when there is a past cache; no softcap; no requested qk output. Rotary caches
[max_position, R/2] gathered by position_ids (or already [B, S, R/2]) become FusedAttention's full-width
cos/sin; 4-D q and k rotated in standard ops instead (`x·cos + turn(x)·sin`, what the exporter leaves where
its rewriter writes no RotaryEmbedding: Phi-3's longrope, whose tables switch on the sequence's length) give
the op their tables as they are. Anything else stays a standard Attention node.

What PyTorch's dynamo exporter writes at opset 23 and 24 for transformers' sdpa attention is read as
AttentionFusionPass reads the same attention spelled in standard ops: 4-D keys and values repeated per
query head (opset 23; `match_gqa_repeat`) are taken before the repetition, a cache concatenated outside the
op (`match_kv_concat`) becomes the op's past and present, and an attn_mask built from the attention_mask
input and a comparison of positions (`match_mask_source`) becomes the op's attention_mask and causal flag,
not a bias, so a paged cache can serve it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.match_attention import MaskSource, in_float32, match_gqa_repeat, match_kv_concat, match_mask_source
from cann_llm.passes.pattern import FusionPass, fused_node, producer
from cann_llm.passes.match_rotary import Rotary, match_rotary
from cann_llm.passes.rotary_tables import NodeBuilder, Rotation, computation, paired_rotation, rotary_tables
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput, FusedAttentionOutput, input_at, positional


@dataclass
class StandardAttentionMatch:
    node: gs.Node
    q: gs.Tensor
    k: gs.Tensor
    v: gs.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    four_d: bool
    rotation: Rotation | Rotary | None  # a RotaryEmbedding op's caches, or tables [B|1, 1, S, R] (standard ops)
    mask: gs.Tensor | None  # an explicit bias
    source: MaskSource  # the attention_mask input and causality read from attn_mask, when it is one
    past_key: gs.Tensor | None  # a cache concatenated outside the op: its past (a graph input) and present
    past_value: gs.Tensor | None
    present_key: gs.Tensor | None
    present_value: gs.Tensor | None
    window: int  # a sliding window, from the mask or the cache that keeps the last W - 1 tokens


def _rotation(tensor: gs.Tensor, head_dim: int) -> tuple[gs.Tensor, Rotation] | None:
    node = producer(tensor, "RotaryEmbedding")
    if node is None or (node.domain or "") not in ("", "ai.onnx") or len(node.outputs[0].outputs) != 1:
        return None
    position_ids = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    rotary_dim = int(node.attrs.get("rotary_embedding_dim", 0)) or head_dim
    return node.inputs[0], Rotation(node.inputs[1], node.inputs[2], position_ids, rotary_dim,
                                    int(node.attrs.get("interleaved", 0)))


def _standard_rotation(q: gs.Tensor, k: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor, Rotary] | str | None:
    """(q, k before their rotation, its tables) when both 4-D heads rotate in standard ops by equal tables."""
    found = match_rotary(q), match_rotary(k)
    if found == (None, None):
        return None
    if None in found:
        return "rotary embedding on only one of q and k"
    (q, rotary), (k, key_rotary) = found
    if [computation(t) for t in (rotary.cos, rotary.sin)] != [computation(t) for t in (key_rotary.cos, key_rotary.sin)] \
            or (rotary.rotary_dim, rotary.interleaved) != (key_rotary.rotary_dim, key_rotary.interleaved):
        return "q and k rotate with different tables"
    for table in (rotary.cos, rotary.sin):  # the fused op's tables hold one row a token for every head
        if table.shape is None or len(table.shape) > 4 or len(table.shape) == 4 and table.shape[1] != 1:
            return f"the rotary table {table.name} is not [B|1, 1, S, R]"
    return q, k, rotary


class ConvertAttention(FusionPass):
    """Bring the standard attention ops into the cann op set."""

    name = "AttentionConversionPass"
    anchor = "Attention"

    def match(self, graph: gs.Graph, node: gs.Node) -> StandardAttentionMatch | str:
        if (node.domain or "") not in ("", "ai.onnx"):
            return "not the standard Attention op"
        inputs = list(node.inputs) + [gs.Variable.empty()] * (7 - len(node.inputs))
        q, k, v, mask, past_key, past_value, nonpad = inputs[:7]
        if nonpad.name:
            return "nonpad_kv_seqlen is not supported"
        if float(node.attrs.get("softcap", 0.0)) != 0.0:
            return "softcap is not supported"
        if len(node.outputs) > 3 and node.outputs[3].outputs:
            return "the qk output is read"
        if bool(past_key.name) != bool(past_value.name):
            return "a cache for only one of keys and values"
        if not in_float32(q, k, v, past_key if past_key.name else None):
            return "not float32 (the fused op computes in float32)"
        rank = len(q.shape or [])
        if rank == 4:
            heads, kv_heads, head_dim = q.shape[1], (k.shape or [None, None])[1], q.shape[3]
        elif rank == 3:
            heads, kv_heads = node.attrs.get("q_num_heads"), node.attrs.get("kv_num_heads")
            head_dim = q.shape[2] // heads if isinstance(q.shape[2], int) and heads else None
        else:
            return "q is neither 3-D nor 4-D"
        if not all(isinstance(d, int) and d > 0 for d in (heads, kv_heads, head_dim)) or heads % kv_heads:
            return "the head counts or the head size are not static and compatible"
        if mask.name and (mask.shape is None or len(mask.shape) != 4 or mask.shape[1] not in (1, heads)):
            return "the attn_mask is not [B|1, H|1, S, T]"
        caches, cache_window = [None] * 4, 0
        if rank == 4 and not past_key.name:  # the op's own past holds the heads as its keys do
            found = self._before_repetition(k, v, heads)
            if isinstance(found, str):
                return found
            k, v, kv_heads = found
            key_cache, value_cache = match_kv_concat(graph, k), match_kv_concat(graph, v)
            if (key_cache.past is None) != (value_cache.past is None):
                return "a cache for only one of keys and values"
            if key_cache.window != value_cache.window:
                return f"the key and value caches keep {key_cache.window - 1} and {value_cache.window - 1} tokens"
            if key_cache.past is not None and node.attrs.get("is_causal", 0):
                # the op aligns is_causal to the top left of scores over past and new keys; the fused op to
                # the bottom right, as a cache needs
                return "is_causal over a cache concatenated outside the op"
            k, v, cache_window = key_cache.new, value_cache.new, key_cache.window
            caches = [key_cache.past, value_cache.past, key_cache.present, value_cache.present]
        source = MaskSource(None, 0)
        if mask.name and mask.shape[1] == 1:
            read = match_mask_source(graph, mask)
            if isinstance(read, MaskSource) and (read.attention_mask is not None or read.causal):
                source, mask = read, gs.Variable.empty()
        if caches[0] is not None and (refusal := source.refusal_over_a_past()):
            return refusal
        if cache_window:
            # a cache that keeps the last W - 1 tokens is read with the window W: the mask must say the same
            if mask.name:
                return "a sliding-window cache with an attn_mask the fusion does not read"
            if not source.causal:
                return "a sliding-window cache without a causal mask"
            if source.window and source.window != cache_window:
                return f"the mask's window ({source.window}) is not the cache's ({cache_window})"
        window = source.window or cache_window
        rotation = None
        paired = paired_rotation(_rotation(q, head_dim), _rotation(k, head_dim))
        if paired is None and rank == 4:
            paired = _standard_rotation(q, k)
        if isinstance(paired, str):
            return paired
        if paired is not None:
            q, k, rotation = paired
        return StandardAttentionMatch(node, q, k, v, heads, kv_heads, head_dim, rank == 4, rotation,
                                      mask if mask.name else None, source, *caches, window)

    @staticmethod
    def _before_repetition(k: gs.Tensor, v: gs.Tensor, heads: int) -> tuple[gs.Tensor, gs.Tensor, int] | str:
        """4-D keys and values before a repetition of each KV head for its query heads, and the KV heads."""
        found = [match_gqa_repeat(t) for t in (k, v)]
        if found == [None, None]:
            return k, v, k.shape[1]
        if None in found:
            return "the keys or the values alone are repeated per query head"
        (k, key_repeats), (v, value_repeats) = found
        kv_heads = [t.shape[1] if t.shape is not None and len(t.shape) == 4 else None for t in (k, v)]
        if kv_heads[0] != kv_heads[1] or not isinstance(kv_heads[0], int) or heads % kv_heads[0] or any(
                r is not None and r * kv_heads[0] != heads for r in (key_repeats, value_repeats)):
            return f"the keys and values are repeated {key_repeats} and {value_repeats} times for {heads} heads"
        return k, v, kv_heads[0]

    def rewrite(self, graph: gs.Graph, match: StandardAttentionMatch) -> None:
        node, prefix = match.node, match.node.name or "attention"
        add = NodeBuilder(graph, prefix)
        const = add.const

        def flat(tensor: gs.Tensor) -> gs.Tensor:
            if not match.four_d:
                return tensor
            moved = add("Transpose", [tensor], {"perm": [0, 2, 1, 3]}, dtype=tensor.dtype)
            return add("Reshape", [moved, const([0, 0, -1])], dtype=tensor.dtype)

        query, key, value = flat(match.q), flat(match.k), flat(match.v)
        cos = sin = None
        rotation = match.rotation
        if isinstance(rotation, Rotary):
            cos, sin = rotation.cos, rotation.sin
        elif rotation is not None:
            cos, sin = rotary_tables(add, rotation, query)
        # the standard Attention's own inputs (ONNX spec): q, k, v, attn_mask, past_key, past_value
        inputs = list(node.inputs) + [gs.Variable.empty()] * (6 - len(node.inputs))
        past_key = match.past_key or input_at(inputs, 4)
        past_value = match.past_value or input_at(inputs, 5)
        # and outputs: Y, present_key, present_value
        output = node.outputs[0]
        fused_output = gs.Variable(f"{prefix}/fused", dtype=output.dtype) if match.four_d else output
        outputs = positional(FusedAttentionOutput, {
            FusedAttentionOutput.OUTPUT: fused_output,
            FusedAttentionOutput.PRESENT_KEY: match.present_key or input_at(node.outputs, 1),
            FusedAttentionOutput.PRESENT_VALUE: match.present_value or input_at(node.outputs, 2)}, gs.Variable.empty())
        scale = node.attrs.get("scale", 1.0 / np.sqrt(match.head_dim))
        node.inputs.clear()
        slot = FusedAttentionInput
        fused_inputs = positional(slot, {
            slot.QUERY: query, slot.KEY: key, slot.VALUE: value, slot.PAST_KEY: past_key, slot.PAST_VALUE: past_value,
            slot.COS: cos, slot.SIN: sin, slot.ATTENTION_BIAS: match.mask,
            slot.ATTENTION_MASK: match.source.attention_mask}, gs.Variable.empty())
        graph.nodes.append(fused_node(
            FUSED_ATTENTION.name, fused_inputs, outputs, f"{prefix}_{FUSED_ATTENTION.name}", num_heads=match.heads,
            kv_num_heads=match.kv_heads, head_dim=match.head_dim, scale=float(scale),
            causal=int(node.attrs.get("is_causal", 0)) | match.source.causal,
            **({"sliding_window": match.window} if match.window else {}),
            rotary_dim=rotation.rotary_dim if rotation else 0, rotary_interleaved=rotation.interleaved if rotation else 0,
            bias_per_head=int(match.mask is not None and match.mask.shape[1] == match.heads and match.heads > 1),
            bias_is_bool=int(match.mask is not None and np.dtype(match.mask.dtype or np.float32) == np.bool_)))
        if match.four_d:
            output.inputs.clear()
            split = add("Reshape", [fused_output, const([0, 0, match.heads, match.head_dim])], dtype=output.dtype)
            add("Transpose", [split], {"perm": [0, 2, 1, 3]}, output=output)
