"""cann::FusedAttention in paged mode (`paged=1`): the host kernels over the runtime's page pool.

Each layer's cache is a pair of arrays `[num_pages, kv_heads, page_size, head_dim]`, so one head's page is
a contiguous `[page_size, head_dim]` tile. A step's tokens come flattened (`[1, T, ·]`), sequence b
owning rows `query_start_loc[b]:query_start_loc[b+1]` and `seq_lens[b]` tokens of context including
them; token t's key and value go to slot `slot_mapping[t]` (page `slot // page_size`, row
`slot % page_size`), and sequence b's pages are `block_tables[b]`.

Three implementations of one contract, tested against each other:
- `paged_attention_reference` (numpy): gathers each context and masks a full score matrix. The spec.
- `paged_attention` (numba): each (sequence, head, block of queries) reads the pages in place with an
  online softmax, so its scratch memory is one page of scores whatever the context length. Decode steps
  (one query per sequence) run it serially, bigger steps in parallel over sequences × heads × blocks.
- `flash_prefill` (numpy + BLAS): a long prompt chunk attends block by block (queries × a few pages of
  keys at a time) with the same online softmax, so scratch memory grows linearly with the context
  and the products run as matrix multiplications.
"""

from __future__ import annotations

import numba
import numpy as np

QUERY_BLOCK = 32
PARALLEL_WORK = 1 << 16  # query·key pairs per head from which numba's threads pay for their wake-up
FLASH_MIN_QUERIES = 64  # prompt chunks at least this long attend through flash_prefill
FLASH_KEY_BLOCK = 512
FLASH_QUERY_BLOCK = 256


def is_paged_attention(node) -> bool:
    """Whether an ONNX node is a paged FusedAttention (a host node of the executor)."""
    return node.op_type == "FusedAttention" and any(a.name == "paged" and a.i == 1 for a in node.attribute)


# ---- rotary embedding and the cache write ----------------------------------------------------------

@numba.njit(fastmath=True, cache=True)
def _rotate(src, offset, heads, head_dim, cos, sin, interleaved, out):
    """out[t, h] = rotary(src[t, offset + h·D : offset + (h+1)·D]) for every token t and head h."""
    rotary = cos.shape[1]
    half = rotary // 2
    for t in range(src.shape[0]):
        for h in range(heads):
            base = offset + h * head_dim
            for d in range(head_dim):
                x = src[t, base + d]
                if d >= rotary:
                    out[t, h, d] = x
                elif interleaved:
                    pair = src[t, base + (d ^ 1)]
                    out[t, h, d] = x * cos[t, d] + (pair if d & 1 else -pair) * sin[t, d]
                elif d < half:
                    out[t, h, d] = x * cos[t, d] - src[t, base + d + half] * sin[t, d]
                else:
                    out[t, h, d] = x * cos[t, d] + src[t, base + d - half] * sin[t, d]


@numba.njit(cache=True)
def _store(k, v, slot_mapping, key_cache, value_cache):
    page_size = key_cache.shape[2]
    for t in range(k.shape[0]):
        page, row = slot_mapping[t] // page_size, slot_mapping[t] % page_size
        key_cache[page, :, row, :] = k[t]
        value_cache[page, :, row, :] = v[t]


def rotate_heads(query, key, value, cos, sin, *, num_heads: int, kv_num_heads: int, head_dim: int,
                 rotary_interleaved: int = 0):
    """Flattened projections `[1, T, ·]` (packed q|k|v when `key` is None) → rotated q `[T, Hq, D]`,
    rotated k and v `[T, Hkv, D]`."""
    tokens = query.shape[1]
    qsrc = query[0]
    ksrc, kofs = (qsrc, num_heads * head_dim) if key is None else (key[0], 0)
    vsrc, vofs = (qsrc, (num_heads + kv_num_heads) * head_dim) if key is None else (value[0], 0)
    if cos is None:
        cos = sin = np.zeros((tokens, 0), np.float32)
    else:
        cos = np.broadcast_to(cos.reshape(-1, cos.shape[-1]), (tokens, cos.shape[-1]))
        sin = np.broadcast_to(sin.reshape(-1, sin.shape[-1]), (tokens, sin.shape[-1]))
    q = np.empty((tokens, num_heads, head_dim), np.float32)
    k = np.empty((tokens, kv_num_heads, head_dim), np.float32)
    _rotate(qsrc, 0, num_heads, head_dim, cos, sin, rotary_interleaved, q)
    _rotate(ksrc, kofs, kv_num_heads, head_dim, cos, sin, rotary_interleaved, k)
    v = np.ascontiguousarray(vsrc[:, vofs:vofs + kv_num_heads * head_dim]).reshape(tokens, kv_num_heads, head_dim)
    return q, k, v


def write_kv(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Store token t's `[Hkv, D]` key and value at its slot."""
    _store(key, value, slot_mapping, key_cache, value_cache)


# ---- the reference ---------------------------------------------------------------------------------

def _context(cache: np.ndarray, pages: np.ndarray, length: int) -> np.ndarray:
    """A sequence's first `length` cached tokens, gathered: `[Hkv, length, D]`."""
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return cache[pages].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :length]


def paged_attention_reference(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """Causal attention of each sequence's queries over its paged context; q `[T, Hq, D]` → `[T, Hq, D]`."""
    kv_heads, page_size = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = np.empty_like(q)
    for b in range(len(seq_lens)):
        start, end, length = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pages = block_tables[b, :-(-length // page_size)]
        keys, values = _context(key_cache, pages, length), _context(value_cache, pages, length)
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


# ---- the numba kernel ------------------------------------------------------------------------------

@numba.njit(cache=True)
def _work_items(query_start_loc, num_heads, block):
    """(sequence, head, first query, end query) for every block of every head of every sequence."""
    count = 0
    for b in range(query_start_loc.shape[0] - 1):
        count += (query_start_loc[b + 1] - query_start_loc[b] + block - 1) // block * num_heads
    items = np.empty((count, 4), np.int64)
    i = 0
    for b in range(query_start_loc.shape[0] - 1):
        for first in range(query_start_loc[b], query_start_loc[b + 1], block):
            for h in range(num_heads):
                items[i, 0], items[i, 1], items[i, 2] = b, h, first
                items[i, 3] = min(first + block, query_start_loc[b + 1])
                i += 1
    return items


@numba.njit(fastmath=True, cache=True)
def _attend_item(w, q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out):
    head_dim, page_size = q.shape[2], key_cache.shape[2]
    b, h, first, last = work[w, 0], work[w, 1], work[w, 2], work[w, 3]
    kv = h // (q.shape[1] // key_cache.shape[1])
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


@numba.njit(cache=True)
def _attend_serial(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out):
    for w in range(work.shape[0]):
        _attend_item(w, q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out)


@numba.njit(parallel=True, cache=True)
def _attend_parallel(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out):
    for w in numba.prange(work.shape[0]):
        _attend_item(w, q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, work, out)


def paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """The numba kernel: same contract as `paged_attention_reference`, pages read in place."""
    out = np.empty_like(q)
    work = _work_items(query_start_loc, q.shape[1], QUERY_BLOCK)
    pairs = int(np.dot(np.diff(query_start_loc).astype(np.int64), seq_lens.astype(np.int64)))
    attend = _attend_parallel if pairs >= PARALLEL_WORK else _attend_serial
    attend(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, np.float32(scale), work, out)
    return out


# ---- blockwise prefill -----------------------------------------------------------------------------

def flash_prefill(q, key_cache, value_cache, pages, length, scale, out):
    """One sequence's query rows q `[S, Hq, D]` (the last S of its `length` tokens) attend causally,
    FLASH_QUERY_BLOCK queries × FLASH_KEY_BLOCK keys at a time with an online softmax; writes `out`."""
    kv_heads, page_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_heads, seq = q.shape[1], q.shape[0]
    group = num_heads // kv_heads
    offset = length - seq
    key_pages = max(1, FLASH_KEY_BLOCK // page_size)
    for q0 in range(0, seq, FLASH_QUERY_BLOCK):
        q1 = min(q0 + FLASH_QUERY_BLOCK, seq)
        rows = q1 - q0
        queries = q[q0:q1].transpose(1, 0, 2).reshape(kv_heads, group * rows, head_dim) * np.float32(scale)
        positions = np.tile(np.arange(offset + q0, offset + q1), group)
        running_max = np.full((kv_heads, group * rows, 1), -np.inf, np.float32)
        total = np.zeros((kv_heads, group * rows, 1), np.float32)
        acc = np.zeros((kv_heads, group * rows, head_dim), np.float32)
        visible_end = offset + q1
        for p0 in range(0, -(-visible_end // page_size), key_pages):
            chunk = pages[p0:p0 + key_pages]
            k0 = p0 * page_size
            width = min(len(chunk) * page_size, visible_end - k0)
            keys = key_cache[chunk].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :width]
            values = value_cache[chunk].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :width]
            scores = np.matmul(queries, keys.swapaxes(1, 2))
            if k0 + width - 1 > offset + q0:  # the block crosses the diagonal: mask the future
                hidden = np.arange(k0, k0 + width)[None, :] > positions[:, None]
                scores[:, hidden] = -np.inf
            new_max = np.maximum(running_max, scores.max(axis=-1, keepdims=True))
            correction = np.exp(running_max - new_max)
            probs = np.exp(scores - new_max)
            total = total * correction + probs.sum(axis=-1, keepdims=True)
            acc = acc * correction + np.matmul(probs, values)
            running_max = new_max
        context = (acc / total).reshape(kv_heads, group, rows, head_dim).reshape(num_heads, rows, head_dim)
        out[q0:q1] = context.transpose(1, 0, 2)


# ---- the node --------------------------------------------------------------------------------------

def paged_fused_attention(inputs: list, key_cache: np.ndarray, value_cache: np.ndarray, *, num_heads: int,
                          kv_num_heads: int, head_dim: int, scale: float, rotary_interleaved: int = 0,
                          fast: bool = True, **_attributes) -> np.ndarray:
    """One paged FusedAttention node: rotate, store the new keys and values, attend; returns `[1, T, Hq·D]`.

    `inputs` are the node's 13 inputs (None where absent); the other attributes (`causal`, `rotary_dim`,
    `layer`, `page_size`, ...) are facts the pool and the graph already hold. `fast=False` runs the
    reference.
    """
    query, key, value, cos, sin = inputs[0], inputs[1], inputs[2], inputs[6], inputs[7]
    query_start_loc, seq_lens, block_tables, slot_mapping = inputs[9:13]
    q, k, v = rotate_heads(query, key, value, cos, sin, num_heads=num_heads, kv_num_heads=kv_num_heads,
                           head_dim=head_dim, rotary_interleaved=rotary_interleaved)
    write_kv(k, v, key_cache, value_cache, slot_mapping)
    if not fast:
        out = paged_attention_reference(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)
    else:
        out = _fast_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)
    return out.reshape(1, q.shape[0], num_heads * head_dim)


def _fast_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """Long prompt chunks through flash_prefill, everything else (decodes, short chunks) through numba."""
    lengths = np.diff(query_start_loc)
    long = np.flatnonzero(lengths >= FLASH_MIN_QUERIES)
    if not len(long):
        return paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)
    out = np.empty_like(q)
    page_size = key_cache.shape[2]
    for b in long:
        start, end, length = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        flash_prefill(q[start:end], key_cache, value_cache, block_tables[b, :-(-length // page_size)], length,
                      scale, out[start:end])
    short = np.flatnonzero(lengths < FLASH_MIN_QUERIES)
    if len(short):
        rows = np.concatenate([np.arange(query_start_loc[b], query_start_loc[b + 1]) for b in short])
        starts = np.concatenate([[0], np.cumsum(lengths[short])]).astype(query_start_loc.dtype)
        out[rows] = paged_attention(q[rows], key_cache, value_cache, starts, seq_lens[short], block_tables[short], scale)
    return out
