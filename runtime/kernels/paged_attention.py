"""cann::FusedAttention in paged mode (`paged=1`): the host kernel over the runtime's page pool.

Each layer's cache is a pair of arrays `[num_pages, kv_heads, page_size, head_dim]`, so one head's page is
a contiguous `[page_size, head_dim]` tile. A step's tokens come flattened (`[1, T, ·]`), sequence b
owning rows `query_start_loc[b]:query_start_loc[b+1]` and `seq_lens[b]` tokens of context including
them; token t's key and value go to slot `slot_mapping[t]` (page `slot // page_size`, row
`slot % page_size`), and sequence b's pages are `block_tables[b]`.

`paged_attention_reference` (numpy, gathers each context and masks a full score matrix) is the spec;
`paged_attention` (numba, parallel over sequences × heads × query blocks) reads the pages in place with
an online softmax, so its scratch memory is a page of scores per worker whatever the context length.
"""

from __future__ import annotations

import numba
import numpy as np

from runtime.kernels.attention import apply_rotary, split_packed

QUERY_BLOCK = 32


def rotate_heads(query, key, value, cos, sin, *, num_heads: int, kv_num_heads: int, head_dim: int,
                 rotary_interleaved: int = 0):
    """Flattened projections `[1, T, ·]` → rotated q `[T, Hq, D]`, rotated k and v `[T, Hkv, D]`."""
    if key is None:
        query, key, value = split_packed(query, num_heads, kv_num_heads, head_dim)
    tokens = query.shape[1]
    q = query.reshape(1, tokens, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = key.reshape(1, tokens, kv_num_heads, head_dim).transpose(0, 2, 1, 3)
    if cos is not None:
        q = apply_rotary(q, cos, sin, rotary_interleaved)
        k = apply_rotary(k, cos, sin, rotary_interleaved)
    v = value.reshape(tokens, kv_num_heads, head_dim)
    return (np.ascontiguousarray(q[0].transpose(1, 0, 2)), np.ascontiguousarray(k[0].transpose(1, 0, 2)),
            np.ascontiguousarray(v))


def write_kv(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Store token t's `[Hkv, D]` key and value at its slot."""
    page_size = key_cache.shape[2]
    pages, rows = slot_mapping // page_size, slot_mapping % page_size
    key_cache[pages, :, rows] = key
    value_cache[pages, :, rows] = value


def paged_attention_reference(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """Causal attention of each sequence's queries over its paged context; q `[T, Hq, D]` → `[T, Hq, D]`."""
    kv_heads, page_size = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = np.empty_like(q)
    for b in range(len(seq_lens)):
        start, end, length = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pages = block_tables[b, :-(-length // page_size)]
        keys = key_cache[pages].transpose(1, 0, 2, 3).reshape(kv_heads, -1, q.shape[2])[:, :length]
        values = value_cache[pages].transpose(1, 0, 2, 3).reshape(kv_heads, -1, q.shape[2])[:, :length]
        queries = q[start:end].transpose(1, 0, 2).reshape(kv_heads, group, end - start, -1)
        scores = np.matmul(queries, keys[:, None].swapaxes(-1, -2)) * np.float32(scale)
        positions = np.arange(length - (end - start), length)
        visible = np.arange(length)[None, :] <= positions[:, None]
        scores = np.where(visible, scores, np.finfo(np.float32).min)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        context = np.matmul(probs, values[:, None]).reshape(q.shape[1], end - start, -1)
        out[start:end] = context.transpose(1, 0, 2)
    return out


@numba.njit(parallel=True, fastmath=True, cache=True)
def _paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out):
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size = key_cache.shape[2]
    group = num_heads // key_cache.shape[1]
    for w in numba.prange(work.shape[0]):
        b, h, first, last = work[w, 0], work[w, 1], work[w, 2], work[w, 3]
        kv = h // group
        length = seq_lens[b]
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        scores = np.empty(page_size, dtype=np.float32)
        acc = np.empty(head_dim, dtype=np.float32)
        for t in range(first, last):
            position = length - q_len + (t - query_start_loc[b])
            running_max = np.float32(-np.inf)
            total = np.float32(0.0)
            acc[:] = 0.0
            for page_index in range(position // page_size + 1):
                page = block_tables[b, page_index]
                rows = min(page_size, position + 1 - page_index * page_size)
                page_max = np.float32(-np.inf)
                for r in range(rows):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q[t, h, d] * key_cache[page, kv, r, d]
                    s *= scale
                    scores[r] = s
                    page_max = max(page_max, s)
                new_max = max(running_max, page_max)
                correction = np.exp(running_max - new_max)
                total *= correction
                for d in range(head_dim):
                    acc[d] *= correction
                for r in range(rows):
                    p = np.exp(scores[r] - new_max)
                    total += p
                    for d in range(head_dim):
                        acc[d] += p * value_cache[page, kv, r, d]
                running_max = new_max
            for d in range(head_dim):
                out[t, h, d] = acc[d] / total


def _work_items(query_start_loc: np.ndarray, num_heads: int) -> np.ndarray:
    """(sequence, head, first query, end query) blocks: long prefills split so both cores get work."""
    items = []
    for b in range(len(query_start_loc) - 1):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        for first in range(start, end, QUERY_BLOCK):
            items.extend((b, h, first, min(first + QUERY_BLOCK, end)) for h in range(num_heads))
    return np.asarray(items, dtype=np.int64).reshape(-1, 4)


def paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """The numba kernel: same contract as `paged_attention_reference`, pages read in place."""
    out = np.empty_like(q)
    work = _work_items(query_start_loc, q.shape[1])
    _paged_attention(q, key_cache, value_cache, query_start_loc.astype(np.int64), seq_lens.astype(np.int64),
                     block_tables.astype(np.int64), np.float32(scale), work, out)
    return out


def is_paged_attention(node) -> bool:
    """Whether an ONNX node is a paged FusedAttention (a host node of the executor)."""
    return node.op_type == "FusedAttention" and any(a.name == "paged" and a.i == 1 for a in node.attribute)


def paged_fused_attention(inputs: list, key_cache: np.ndarray, value_cache: np.ndarray, *, num_heads: int,
                          kv_num_heads: int, head_dim: int, scale: float, rotary_interleaved: int = 0,
                          fast: bool = True, **_attributes) -> np.ndarray:
    """One paged FusedAttention node: rotate, store the new keys and values, attend; returns `[1, T, Hq·D]`.

    `inputs` are the node's 13 inputs (None where absent); the other attributes (`causal`, `rotary_dim`,
    `layer`, `page_size`, ...) are facts the pool and the graph already hold.
    """
    query, key, value, cos, sin = inputs[0], inputs[1], inputs[2], inputs[6], inputs[7]
    query_start_loc, seq_lens, block_tables, slot_mapping = inputs[9:13]
    q, k, v = rotate_heads(query, key, value, cos, sin, num_heads=num_heads, kv_num_heads=kv_num_heads,
                           head_dim=head_dim, rotary_interleaved=rotary_interleaved)
    write_kv(k.astype(key_cache.dtype), v.astype(value_cache.dtype), key_cache, value_cache, slot_mapping)
    attend = paged_attention if fast else paged_attention_reference
    out = attend(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)
    return out.reshape(1, q.shape[0], num_heads * head_dim).astype(query.dtype, copy=False)
