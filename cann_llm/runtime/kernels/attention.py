"""Reference kernel of cann::FusedAttention with a contiguous KV cache (docs/ops.md is its spec).

Computed in float32 in the order of the unfused graphs: projections split into heads, rotary embedding
on q and k, past and new keys concatenated, scores scaled, masked with the dtype's minimum, softmax,
weighted sum, heads merged.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import FUSED_ATTENTION


def _heads(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    batch, seq, _ = x.shape
    return x.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int = 0) -> np.ndarray:
    """x [B, H, S, D]; cos, sin broadcastable to [B, 1, S, R] with R ≤ D: the first R dims rotate."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        even, odd = rotated[..., 0::2], rotated[..., 1::2]
        turned = np.stack([-odd, even], axis=-1).reshape(rotated.shape)
    else:
        half = rotary_dim // 2
        turned = np.concatenate([-rotated[..., half:], rotated[..., :half]], axis=-1)
    return np.concatenate([rotated * cos + turned * sin, passed], axis=-1)


def split_packed(qkv: np.ndarray, num_heads: int, kv_num_heads: int, head_dim: int):
    """A packed [B, S, (Hq + 2·Hkv)·D] projection → query, key, value."""
    q_size, kv_size = num_heads * head_dim, kv_num_heads * head_dim
    return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]


def attention_mask_bias(seq: int, total: int, attention_mask: np.ndarray | None, causal: int,
                        dtype=np.float32, sliding_window: int = 0) -> np.ndarray:
    """[B|1, 1, S, T]: 0 where query i may see key j, the dtype's minimum elsewhere.

    Query i sits at absolute position p = T - S + i; causal attention sees keys at positions ≤ p, and
    with a sliding window W only the last W of them (positions > p - W).
    """
    allowed = np.ones((1, 1, seq, total), dtype=bool)
    positions = np.arange(seq)[:, None] + (total - seq)
    if causal:
        allowed &= (np.arange(total)[None, :] <= positions)[None, None]
    if sliding_window:
        allowed &= (np.arange(total)[None, :] > positions - sliding_window)[None, None]
    if attention_mask is not None:
        allowed = allowed & (attention_mask != 0)[:, None, None, :]
    return np.where(allowed, np.float32(0), np.finfo(dtype).min).astype(dtype)


def alibi_bias(slopes, kv_num_heads: int, seq: int, total: int, attention_mask: np.ndarray | None = None
               ) -> np.ndarray:
    """[B|1, Hkv, G, S, T]: m_h·(position of key j - position of query i), positions the keys' index (query i
    at T - S + i) or, given `attention_mask`, counted over the keys it keeps (ALiBi; relative, as any constant
    a query row adds leaves its softmax unchanged)."""
    if attention_mask is None:
        positions = np.arange(total)[None]
    else:
        positions = np.cumsum(attention_mask != 0, axis=-1) - 1
    distance = positions[:, None, :] - positions[:, total - seq:, None]
    return (np.asarray(slopes, np.float32).reshape(1, kv_num_heads, -1, 1, 1)
            * distance[:, None, None].astype(np.float32))


def explicit_bias(bias: np.ndarray, kv_num_heads: int, group: int, dtype=np.float32) -> np.ndarray:
    """An [B|1, H|1, S, T] mask (boolean: True attends; float: added) as an additive [B|1, Hkv|1, G|1, S, T]."""
    if bias.dtype == np.bool_:
        bias = np.where(bias, np.float32(0), np.finfo(dtype).min).astype(dtype)
    if bias.shape[1] == 1:
        return bias[:, :, None]
    return bias.reshape(bias.shape[0], kv_num_heads, group, *bias.shape[2:])


@register_kernel(FUSED_ATTENTION)
def FusedAttention(query, key=None, value=None, past_key=None, past_value=None, attention_mask=None,
                   cos=None, sin=None, attention_bias=None, *, num_heads: int, kv_num_heads: int, head_dim: int,
                   scale: float, causal: int, rotary_dim: int, rotary_interleaved: int, bias_per_head: int,
                   bias_is_bool: int, sliding_window: int, softcap: float = 0.0, alibi_slopes=(),
                   alibi_from_mask: int = 0, sinks=()):
    """softmax(rope(q) · rope(k)ᵀ · scale + mask [+ bias]) · v over all heads (with `softcap` c > 0 the
    scaled scores capped to c·tanh(scores / c) first; with `alibi_slopes` m_h, m_h·(j - p) added to head h's
    score of the key at position j from a query at p, positions counted over the keys attention_mask keeps
    with `alibi_from_mask`; with `sinks` s_h, exp(s_h) counted in head h's softmax beside its scores, for no
    value); returns (output, present_key, present_value).

    `rotary_dim` restates cos's last dimension, `bias_per_head` the bias's head axis (H, else 1) and
    `bias_is_bool` its type, for lowerings that need them before run time.
    """
    del rotary_dim, bias_per_head, bias_is_bool
    if key is None:
        query, key, value = split_packed(query, num_heads, kv_num_heads, head_dim)
    q = _heads(query, num_heads, head_dim)
    k = _heads(key, kv_num_heads, head_dim)
    v = _heads(value, kv_num_heads, head_dim)
    if cos is not None:
        q = apply_rotary(q, cos, sin, rotary_interleaved)
        k = apply_rotary(k, cos, sin, rotary_interleaved)
    if past_key is not None:
        k = np.concatenate([past_key, k], axis=2)
        v = np.concatenate([past_value, v], axis=2)
    batch, _, seq, _ = q.shape
    group = num_heads // kv_num_heads
    q5 = q.reshape(batch, kv_num_heads, group, seq, head_dim)
    scores = np.matmul(q5, np.swapaxes(k, -1, -2)[:, :, None]) * np.float32(scale)
    if softcap:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    if len(alibi_slopes):
        counted = attention_mask if alibi_from_mask else None
        scores = scores + alibi_bias(alibi_slopes, kv_num_heads, seq, k.shape[2], counted)
    scores = scores + attention_mask_bias(seq, k.shape[2], attention_mask, causal, q.dtype, sliding_window)[:, :, None]
    if attention_bias is not None:
        scores = scores + explicit_bias(attention_bias, kv_num_heads, group, q.dtype)
    total = k.shape[2]
    if len(sinks):  # a column of its own, dropped after the softmax
        column = np.float32(sinks).reshape(kv_num_heads, group, 1, 1)
        scores = np.concatenate([scores, np.broadcast_to(column, scores.shape[:-1] + (1,))], axis=-1)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = (scores / scores.sum(axis=-1, keepdims=True))[..., :total]
    context = np.matmul(probs, v[:, :, None]).reshape(batch, num_heads, seq, head_dim)
    output = context.transpose(0, 2, 1, 3).reshape(batch, seq, num_heads * head_dim).astype(query.dtype)
    return output, k, v
