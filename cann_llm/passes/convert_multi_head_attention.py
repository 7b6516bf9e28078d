"""MultiHeadAttentionConversionPass: com.microsoft.MultiHeadAttention, with the com.microsoft
RotaryEmbedding nodes that rotate its query and key, → cann::FusedAttention.

What onnxruntime's transformer optimizer (FusionRotaryAttention) and onnxscript's MHA fusion write:
3-D query, key and value [B, S, N·H], an optional BNSH past, a 2-D key_padding_mask [B, P + S] (0 = a
masked key: FusedAttention's attention_mask), an attention_bias [B|1, N|1, S, P + S] (FusedAttention's
explicit bias), `unidirectional` (causal, aligned to the end of the cache as FusedAttention is). The
RotaryEmbedding's caches [max_position, R/2] are read at its position_ids [B, S], or from a one-element
start position onward. Refused: the packed bias, packed or cross-attention (4-D/5-D) key and value,
other key_padding_mask forms (lengths, 3-D), past_sequence_length and cache_indirection (the decoder
masked form), the qk output, rotary `scale` ≠ 1 or packed batching, a rotation of q or k alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.match_attention import in_float32
from cann_llm.passes.pattern import FusionPass, fused_node, producer
from cann_llm.passes.rotary_tables import NodeBuilder, Rotation, paired_rotation, rotary_tables
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput, FusedAttentionOutput, input_at, positional

MICROSOFT_DOMAIN = "com.microsoft"
_UNSUPPORTED_INPUTS = {3: "the packed q/k/v bias", 8: "past_sequence_length", 9: "cache_indirection"}


@dataclass
class MultiHeadAttentionMatch:
    node: gs.Node
    q: gs.Tensor
    k: gs.Tensor
    heads: int
    head_dim: int
    rotation: Rotation | None
    mask: gs.Tensor | None
    bias: gs.Tensor | None


def _unrotated(tensor: gs.Tensor) -> gs.Tensor:
    node = producer(tensor, "RotaryEmbedding")
    return node.inputs[0] if node is not None else tensor


def microsoft_rotation(tensor: gs.Tensor, head_dim: int) -> tuple[gs.Tensor, Rotation] | str | None:
    """(the unrotated input, its rotation) if `tensor` is a com.microsoft RotaryEmbedding's output read
    only by the attention; None if it is no rotation, a reason if it is one FusedAttention cannot take."""
    node = producer(tensor, "RotaryEmbedding")
    if node is None or node.domain != MICROSOFT_DOMAIN:
        return None
    if len(tensor.outputs) != 1:
        return "the rotated tensor has other readers"
    if float(node.attrs.get("scale", 1.0)) != 1.0 or node.attrs.get("is_packed_batching", 0):
        return "the rotation has a scale or packed batching"
    x, positions, cos, sin = node.inputs[:4]
    if x.shape is None or len(x.shape) != 3:
        return "the rotation's input is not [B, S, N·H]"
    rotary_dim = int(node.attrs.get("rotary_embedding_dim", 0)) or head_dim
    if cos.shape is None or cos.shape[-1] != rotary_dim // 2:
        return f"the rotary caches are not [max_position, {rotary_dim // 2}]"
    if positions.shape is None or len(positions.shape) not in (1, 2):
        return "the rotation's position_ids are neither [1] nor [B, S]"
    offset = len(positions.shape) == 1
    return x, Rotation(cos, sin, positions, rotary_dim, int(node.attrs.get("interleaved", 0)), offset)


class ConvertMultiHeadAttention(FusionPass):
    """Bring onnxruntime's MultiHeadAttention (and its RotaryEmbedding) into the cann op set."""

    name = "MultiHeadAttentionConversionPass"
    anchor = "MultiHeadAttention"

    def match(self, graph: gs.Graph, node: gs.Node) -> MultiHeadAttentionMatch | str:
        if node.domain != MICROSOFT_DOMAIN:
            return "not com.microsoft's MultiHeadAttention"
        for index, what in _UNSUPPORTED_INPUTS.items():
            if input_at(node.inputs, index) is not None:
                return f"{what} is not supported"
        if len(node.outputs) > 3 and node.outputs[3].name:
            return "the qk output is requested"
        q, k, v = (input_at(node.inputs, i) for i in range(3))
        if k is None or v is None:
            return "packed query, key and value"
        if not in_float32(q, k, v, input_at(node.inputs, 6)):
            return "not float32 (the fused op computes in float32)"
        # shape inference may not know a contrib RotaryEmbedding's output: its input's shape is the same
        shapes = [(_unrotated(t).shape) for t in (q, k, v)]
        if any(shape is None or len(shape) != 3 for shape in shapes):
            return "query, key and value are not all [B, S, N·H] (packed or cross-attention)"
        if (input_at(node.inputs, 6) is None) != (input_at(node.inputs, 7) is None):
            return "a cache for only one of keys and values"
        heads, width = int(node.attrs.get("num_heads", 0)), shapes[0][-1]
        if heads <= 0 or not isinstance(width, int) or width % heads or any(shape[-1] != width for shape in shapes):
            return "the head count or the widths are not static and equal"
        head_dim = width // heads
        mask, bias = input_at(node.inputs, 4), input_at(node.inputs, 5)
        if mask is not None and (mask.shape is None or len(mask.shape) != 2):
            return "the key_padding_mask is not [B, P + S] (lengths or 3-D)"
        if bias is not None and (bias.shape is None or len(bias.shape) != 4 or bias.shape[1] not in (1, heads)):
            return "the attention_bias is not [B|1, N|1, S, P + S]"
        rotated_q, rotated_k = microsoft_rotation(q, head_dim), microsoft_rotation(k, head_dim)
        for found in (rotated_q, rotated_k):
            if isinstance(found, str):
                return found
        rotation = None
        paired = paired_rotation(rotated_q, rotated_k)
        if isinstance(paired, str):
            return paired
        if paired is not None:
            q, k, rotation = paired
        return MultiHeadAttentionMatch(node, q, k, heads, head_dim, rotation, mask, bias)

    def rewrite(self, graph: gs.Graph, match: MultiHeadAttentionMatch) -> None:
        node = match.node
        b = NodeBuilder(graph, node.name or "mha")
        cos = sin = None
        if match.rotation is not None:
            cos, sin = rotary_tables(b, match.rotation, match.q)
        # MultiHeadAttention's own slots (com.microsoft's spec): value 2, past_key 6, past_value 7
        slot = FusedAttentionInput
        inputs = positional(slot, {
            slot.QUERY: match.q, slot.KEY: match.k, slot.VALUE: node.inputs[2], slot.PAST_KEY: input_at(node.inputs, 6),
            slot.PAST_VALUE: input_at(node.inputs, 7), slot.ATTENTION_MASK: match.mask, slot.COS: cos, slot.SIN: sin,
            slot.ATTENTION_BIAS: match.bias}, gs.Variable.empty())
        # and its outputs: output, present_key, present_value
        outputs = positional(FusedAttentionOutput, {
            FusedAttentionOutput.OUTPUT: node.outputs[0], FusedAttentionOutput.PRESENT_KEY: input_at(node.outputs, 1),
            FusedAttentionOutput.PRESENT_VALUE: input_at(node.outputs, 2)}, gs.Variable.empty())
        scale = float(node.attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(match.head_dim))
        node.inputs.clear()
        bias = match.bias
        graph.nodes.append(fused_node(
            FUSED_ATTENTION.name, inputs, outputs, f"{node.name}_{FUSED_ATTENTION.name}", num_heads=match.heads,
            kv_num_heads=match.heads, head_dim=match.head_dim, scale=scale,
            causal=int(node.attrs.get("unidirectional", 0)),
            rotary_dim=match.rotation.rotary_dim if match.rotation else 0,
            rotary_interleaved=match.rotation.interleaved if match.rotation else 0,
            bias_per_head=int(bias is not None and bias.shape[1] == match.heads and match.heads > 1),
            bias_is_bool=int(bias is not None and np.dtype(bias.dtype or np.float32) == np.bool_)))
