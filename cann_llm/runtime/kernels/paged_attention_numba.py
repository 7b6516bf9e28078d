"""The numba kernels of cann::PagedAttention (cann_llm/runtime/kernels/paged_attention.py holds the contract, the
numpy references and the Python entry points that call these).

Imported only at the first fast call of the host path: paged artifacts run their attention in the native op
inside onnxruntime (cann_llm/runtime/kernels/native), so a process that never falls back to these kernels never
imports numba (tens of MB of resident memory and a fifth of a second of start-up).

Each query row reads its sequence's pages in place with an online softmax, the query heads sharing a KV head
attending together (each key and value row is read once for the group), so scratch memory is one page of
scores whatever the context length. Decode steps (one query per sequence) rotate, write the cache and attend
in one call (`_decode_step`: the numba dispatches of a step are a measurable share of a batch-1 token).

The kernels use numpy's error model: float arithmetic on NaN or infinite operands (weights a file carries,
say) gives NaN or inf as numpy would, instead of raising ZeroDivisionError from inside a step.
"""

from __future__ import annotations

import os

# numba's parallel kernels run between onnxruntime sessions on the same cores; OpenMP threads that keep
# spinning after a kernel slow the next session down (docs/performance.md#thread-pools).
# libgomp reads this when numba first starts it, which is after this import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
import numpy as np  # noqa: E402

from cann_llm.runtime.kernels.fast_math import fast_exp, larger, smaller  # noqa: E402
from cann_llm.runtime.kernels.prefetch import prefetch  # noqa: E402


# ---- rotary embedding and the cache write ----------------------------------------------------------


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _rotate_row(src, t, base, cos, sin, interleaved, dst):
    """dst = rotary(src[t, base:base + D]) (dims from R on pass through)."""
    rotary = cos.shape[1]
    half = rotary // 2
    for d in range(dst.shape[0]):
        x = src[t, base + d]
        if d >= rotary:
            dst[d] = x
        elif interleaved:
            pair = src[t, base + (d ^ 1)]
            dst[d] = x * cos[t, d] + (pair if d & 1 else -pair) * sin[t, d]
        elif d < half:
            dst[d] = x * cos[t, d] - src[t, base + d + half] * sin[t, d]
        else:
            dst[d] = x * cos[t, d] + src[t, base + d - half] * sin[t, d]


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _rotate_and_store_token(t, qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache,
                            value_cache, q):
    page_size, kv_heads, head_dim = key_cache.shape[2], key_cache.shape[1], key_cache.shape[3]
    for h in range(q.shape[1]):
        _rotate_row(qsrc, t, h * head_dim, cos, sin, interleaved, q[t, h])
    page, row = slot_mapping[t] // page_size, slot_mapping[t] % page_size
    for h in range(kv_heads):
        _rotate_row(ksrc, t, kofs + h * head_dim, cos, sin, interleaved, key_cache[page, h, row])
        for d in range(head_dim):
            value_cache[page, h, row, d] = vsrc[t, vofs + h * head_dim + d]


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _rotate_and_store(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache, value_cache, q):
    for t in range(q.shape[0]):
        _rotate_and_store_token(t, qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache,
                                value_cache, q)


@numba.njit(fastmath=True, error_model="numpy", parallel=True, cache=True)
def _rotate_and_store_parallel(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache,
                               value_cache, q):
    for t in numba.prange(q.shape[0]):
        _rotate_and_store_token(t, qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache,
                                value_cache, q)


# ---- the numba kernel ------------------------------------------------------------------------------

# The two products below take four key or value rows at a time: a dot product's sum across vector lanes and
# an accumulator's trip through memory (numba cannot tell it from the cache) then serve four rows, not one
# (docs/performance.md#paged-attention-kernels). Each also prefetches the same rows of the page read next
# (cann_llm/runtime/kernels/prefetch.py).

@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _prefetch_rows(cache, page, kv, first, count):
    """Prefetch rows first..first+count-1 of cache[page, kv], a cache line (16 floats) at a time."""
    for r in range(first, first + count):
        for d in range(0, cache.shape[3], 16):
            prefetch(cache, page, kv, r, d)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _page_scores(queries, first, key_cache, kv, page, rows, scale, scores, next_page, next_kv):
    """scores[g, r] = scale * queries[first + g] . key_cache[page, kv, r] for r < rows."""
    group, head_dim = scores.shape[0], key_cache.shape[3]
    r = 0
    while r + 4 <= rows:
        _prefetch_rows(key_cache, next_page, next_kv, r, 4)
        k0, k1, k2, k3 = (key_cache[page, kv, r], key_cache[page, kv, r + 1], key_cache[page, kv, r + 2],
                          key_cache[page, kv, r + 3])
        for g in range(group):
            query = queries[first + g]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for d in range(head_dim):
                x = query[d]
                s0 += x * k0[d]
                s1 += x * k1[d]
                s2 += x * k2[d]
                s3 += x * k3[d]
            scores[g, r], scores[g, r + 1], scores[g, r + 2], scores[g, r + 3] = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        r += 4
    for r in range(r, rows):
        key = key_cache[page, kv, r]
        for g in range(group):
            query = queries[first + g]
            s = np.float32(0.0)
            for d in range(head_dim):
                s += query[d] * key[d]
            scores[g, r] = s * scale


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _accumulate_values(weights, value_cache, kv, page, rows, acc, next_page, next_kv):
    """acc[g] += sum over r < rows of weights[g, r] * value_cache[page, kv, r]."""
    group, head_dim = weights.shape[0], value_cache.shape[3]
    r = 0
    while r + 4 <= rows:
        _prefetch_rows(value_cache, next_page, next_kv, r, 4)
        v0, v1, v2, v3 = (value_cache[page, kv, r], value_cache[page, kv, r + 1], value_cache[page, kv, r + 2],
                          value_cache[page, kv, r + 3])
        for g in range(group):
            p0, p1, p2, p3 = weights[g, r], weights[g, r + 1], weights[g, r + 2], weights[g, r + 3]
            row = acc[g]
            for d in range(head_dim):
                row[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
        r += 4
    for r in range(r, rows):
        value = value_cache[page, kv, r]
        for g in range(group):
            p = weights[g, r]
            row = acc[g]
            for d in range(head_dim):
                row[d] += p * value[d]


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attend_heads(q, t, first, key_cache, value_cache, kv, pages, position, window, scale, softcap, slopes, sinks,
                  scores, acc, state, out):
    """out[t, first:first+n] = attention of query heads `first..first+n-1` of token `t` (all reading KV head
    `kv`) over cache positions 0..position (with window > 0: the last `window` of them; pages = the sequence's
    block-table row; softcap > 0 caps the scaled scores to softcap·tanh(s / softcap); `slopes`, one a query
    head or none, add ALiBi's slope·(key position - position); `sinks`, one a query head or none, a logit
    each head's softmax counts beside its scores with no value to it, gpt-oss's), one page of scores at a
    time with an online softmax. Heads sharing a KV head go together, so each key and value row is read once
    for all of them; the exponentials run as a loop of their own (vectorized). q and out are `[T, Hq, D]`;
    scratch: scores `[n, page_size]`, acc `[n, D]`, state `[2, n]`."""
    group = scores.shape[0]
    page_size, head_dim = key_cache.shape[2], key_cache.shape[3]
    running_max, total = state[0], state[1]
    running_max[:] = -np.inf
    total[:] = 0.0
    if sinks.shape[0]:  # the sink starts the online softmax: its exp(sink - max) in the total, nothing in acc
        for g in range(group):
            running_max[g] = sinks[first + g]
            total[g] = 1.0
    acc[:] = 0.0
    last = position // page_size
    oldest = larger(0, position - window + 1) if window > 0 else 0
    for page_index in range(oldest // page_size, last + 1):
        page = pages[page_index]
        rows = smaller(page_size, position + 1 - page_index * page_size)
        hidden = oldest - page_index * page_size  # rows before the window, in its first page
        # the page read next: this head's next one, or the next KV head's first (the caller's next call)
        if page_index < last:
            next_page, next_kv = pages[page_index + 1], kv
        else:
            next_page, next_kv = pages[0], smaller(kv + 1, key_cache.shape[1] - 1)
        _page_scores(q[t], first, key_cache, kv, page, rows, scale, scores, next_page, next_kv)
        if softcap > 0:  # Gemma 2's cap on the scaled scores
            for g in range(group):
                for r in range(rows):
                    scores[g, r] = softcap * np.tanh(scores[g, r] / softcap)
        if slopes.shape[0]:  # ALiBi: m_h·(key position - query position)
            for g in range(group):
                slope = slopes[first + g]
                for r in range(rows):
                    scores[g, r] += slope * np.float32(page_index * page_size + r - position)
        for r in range(larger(hidden, 0)):
            for g in range(group):
                scores[g, r] = -np.inf
        for g in range(group):
            new_max = larger(running_max[g], scores[g, :rows].max())
            correction = fast_exp(running_max[g] - new_max)
            for d in range(head_dim):
                acc[g, d] *= correction
            page_total = np.float32(0.0)
            for r in range(rows):
                p = fast_exp(scores[g, r] - new_max)
                scores[g, r] = p
                page_total += p
            total[g] = total[g] * correction + page_total
            running_max[g] = new_max
        _accumulate_values(scores, value_cache, kv, page, rows, acc, next_page, next_kv)
    for g in range(group):
        for d in range(head_dim):
            out[t, first + g, d] = acc[g, d] / total[g]


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attend_token(q, t, key_cache, value_cache, pages, position, window, scale, softcap, slopes, sinks, out):
    """Token t's attention over cache positions 0..position (the last `window` with window > 0), its query
    heads one KV group at a time."""
    group = out.shape[1] // key_cache.shape[1]
    scores = np.empty((group, key_cache.shape[2]), dtype=np.float32)
    acc = np.empty((group, out.shape[2]), dtype=np.float32)
    state = np.empty((2, group), dtype=np.float32)
    for kv in range(key_cache.shape[1]):
        _attend_heads(q, t, kv * group, key_cache, value_cache, kv, pages, position, window, scale, softcap, slopes, sinks,
                      scores, acc, state, out)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _decode_step(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, seq_lens, block_tables,
                 key_cache, value_cache, window, scale, softcap, slopes, sinks, out):
    """One query per sequence (a decode step), in one call: rotate, store the new key and value, attend.
    out `[T, Hq, D]`."""
    q = np.empty_like(out)
    _rotate_and_store(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache, value_cache, q)
    for t in range(out.shape[0]):
        _attend_token(q, t, key_cache, value_cache, block_tables[t], seq_lens[t] - 1, window, scale, softcap, slopes, sinks,
                      out)


@numba.njit(fastmath=True, error_model="numpy", parallel=True, cache=True)
def _decode_step_parallel(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, seq_lens, block_tables,
                          key_cache, value_cache, window, scale, softcap, slopes, sinks, out):
    """`_decode_step` with the sequences spread over numba's threads (a function of its own: numba's
    cache keys a compiled function by its source, so one body compiled both ways would share one entry)."""
    q = np.empty_like(out)
    _rotate_and_store(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping, key_cache, value_cache, q)
    for t in numba.prange(out.shape[0]):
        _attend_token(q, t, key_cache, value_cache, block_tables[t], seq_lens[t] - 1, window, scale, softcap, slopes, sinks,
                      out)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attend_serial(q, key_cache, value_cache, block_tables, token_seq, positions, window, scale, softcap, slopes, sinks,
                   out):
    for t in range(q.shape[0]):
        _attend_token(q, t, key_cache, value_cache, block_tables[token_seq[t]], positions[t], window, scale, softcap, slopes,
                      sinks, out)


@numba.njit(fastmath=True, error_model="numpy", parallel=True, cache=True)
def _attend_parallel(q, key_cache, value_cache, block_tables, token_seq, positions, window, scale, softcap, slopes, sinks,
                     out):
    n = q.shape[0]
    for i in numba.prange(n):
        # numba hands each thread a contiguous range of i: pairing early tokens (short causal contexts)
        # with late ones (long) gives the threads equal work
        t = i // 2 if i % 2 == 0 else n - 1 - i // 2
        _attend_token(q, t, key_cache, value_cache, block_tables[token_seq[t]], positions[t], window, scale, softcap, slopes,
                      sinks, out)
