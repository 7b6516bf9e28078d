"""cann::PagedAttention: the host kernels over the runtime's page pool (cann_llm/runtime/ops.py is its contract).

Each layer's cache is a pair of arrays `[num_pages, kv_heads, page_size, head_dim]`, so one head's page is
a contiguous `[page_size, head_dim]` tile. A step's tokens come flattened (`[1, T, ·]`), sequence b
owning rows `query_start_loc[b]:query_start_loc[b+1]` and `seq_lens[b]` tokens of context including
them; token t's key and value go to slot `slot_mapping[t]` (page `slot // page_size`, row
`slot % page_size`), and sequence b's pages are `block_tables[b]`.

Three implementations of one contract, tested against each other:
- `paged_attention_reference` (numpy): gathers each context and masks a full score matrix. The spec.
- `paged_attention` (numba, cann_llm/runtime/kernels/paged_attention_numba.py, imported at its first call): each
  query row reads its sequence's pages in place with an online softmax, the query heads sharing a KV head
  attending together, so scratch memory is one page of scores whatever the context length. Rows spread
  over numba's threads once a layer's work pays for their wake-up. Decode steps (one query per sequence)
  rotate, write the cache and attend in one call (`_decode`).
- `flash_prefill` (cann_llm/runtime/kernels/flash_prefill.py, on onnxruntime's kernels): a long prompt chunk
  attends block by block (queries × a block of keys at a time) with the same online softmax, so scratch
  memory grows linearly with the context and the products run as matrix multiplications.

Paged artifacts normally attend in the native op inside onnxruntime (cann_llm/runtime/kernels/native); these host
kernels are its fallback, so importing this module imports no numba.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np

from cann_llm.runtime.kernels import HostRun, register_kernel
from cann_llm.runtime.kernels.attention import apply_rotary
from cann_llm.runtime.kernels.flash_prefill import flash_prefill
from cann_llm.runtime.ops import PAGED_ATTENTION

PARALLEL_WORK = 2048  # query·key pairs in a layer's call from which numba's threads pay for their wake-up
PARALLEL_ROTATE_TOKENS = 64  # the same for rotating and storing a step's tokens
FLASH_MIN_QUERIES = 64  # prompt chunks at least this long attend through flash_prefill
NO_SLOPES = np.zeros(0, np.float32)  # no ALiBi: the numba kernels' empty slopes


@cache
def _numba_kernels():
    """cann_llm/runtime/kernels/paged_attention_numba, imported at the first fast call rather than with this module:
    paged artifacts attend in the native op, so most processes never run a numba kernel and need not pay
    numba's import (its memory and start-up time)."""
    from cann_llm.runtime.kernels import paged_attention_numba

    return paged_attention_numba


# ---- rotary embedding and the cache write ----------------------------------------------------------

def split_heads(query, key, value, num_heads: int, kv_num_heads: int, head_dim: int):
    """The flattened projections `[1, T, ·]` as 2-D sources and column offsets of q, k and v (views only)."""
    qsrc = query[0]
    if key is None:
        return qsrc, qsrc, num_heads * head_dim, qsrc, (num_heads + kv_num_heads) * head_dim
    return qsrc, key[0], 0, value[0], 0


def rotary_tables(cos, sin, tokens: int):
    """cos and sin as `[T, R]` (R = 0 without rotary)."""
    if cos is None:
        empty = np.zeros((tokens, 0), np.float32)
        return empty, empty
    cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    if cos.shape[0] != tokens:
        cos, sin = np.broadcast_to(cos, (tokens, cos.shape[1])), np.broadcast_to(sin, (tokens, sin.shape[1]))
    return cos, sin


def rotate_and_store_reference(query, key, value, cos, sin, slot_mapping, key_cache, value_cache, *,
                               num_heads: int, kv_num_heads: int, head_dim: int, rotary_interleaved: int = 0):
    """numpy: rotated q `[T, Hq, D]`; rotated k and v stored at their slots."""
    qsrc, ksrc, kofs, vsrc, vofs = split_heads(query, key, value, num_heads, kv_num_heads, head_dim)
    tokens = qsrc.shape[0]
    q = qsrc[:, :num_heads * head_dim].reshape(1, tokens, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = ksrc[:, kofs:kofs + kv_num_heads * head_dim].reshape(1, tokens, kv_num_heads, head_dim).transpose(0, 2, 1, 3)
    v = vsrc[:, vofs:vofs + kv_num_heads * head_dim].reshape(tokens, kv_num_heads, head_dim)
    if cos is not None:
        q = apply_rotary(q, cos, sin, rotary_interleaved)
        k = apply_rotary(k, cos, sin, rotary_interleaved)
    page_size = key_cache.shape[2]
    pages, rows = slot_mapping // page_size, slot_mapping % page_size
    key_cache[pages, :, rows] = k[0].transpose(1, 0, 2)
    value_cache[pages, :, rows] = v
    return np.ascontiguousarray(q[0].transpose(1, 0, 2))


def rotate_and_store(query, key, value, cos, sin, slot_mapping, key_cache, value_cache, *, num_heads: int,
                     kv_num_heads: int, head_dim: int, rotary_interleaved: int = 0):
    """numba: same contract as `rotate_and_store_reference`, keys rotated straight into their pages."""
    qsrc, ksrc, kofs, vsrc, vofs = split_heads(query, key, value, num_heads, kv_num_heads, head_dim)
    cos, sin = rotary_tables(cos, sin, qsrc.shape[0])
    q = np.empty((qsrc.shape[0], num_heads, head_dim), np.float32)
    # long chunks run faster on two threads, short ones pay more to start them (docs/performance.md#paged-attention-kernels)
    kernels = _numba_kernels()
    kernel = kernels._rotate_and_store_parallel if qsrc.shape[0] >= PARALLEL_ROTATE_TOKENS else kernels._rotate_and_store
    kernel(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, rotary_interleaved, slot_mapping, key_cache, value_cache, q)
    return q


# ---- the reference ---------------------------------------------------------------------------------

def _context(cache: np.ndarray, pages: np.ndarray, length: int) -> np.ndarray:
    """A sequence's first `length` cached tokens, gathered: `[Hkv, length, D]`."""
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return cache[pages].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :length]


def paged_attention_reference(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                              sliding_window: int = 0, softcap: float = 0.0, alibi_slopes=NO_SLOPES, sinks=NO_SLOPES):
    """Causal attention of each sequence's queries over its paged context (with a sliding window W > 0,
    over the last W positions up to each query's own; with softcap c > 0, the scaled scores capped to
    c·tanh(s / c); with `alibi_slopes` m_h, m_h·(key position - query position) added to head h's scores;
    with `sinks` s_h, exp(s_h) counted in head h's softmax beside its scores, for no value);
    q `[T, Hq, D]` → `[T, Hq, D]`."""
    kv_heads, page_size = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = np.empty_like(q)
    for b in range(len(seq_lens)):
        start, end, length = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pages = block_tables[b, :-(-length // page_size)]
        keys, values = _context(key_cache, pages, length), _context(value_cache, pages, length)
        queries = q[start:end].transpose(1, 0, 2).reshape(kv_heads, group, end - start, -1)
        scores = np.matmul(queries, keys[:, None].swapaxes(-1, -2)) * np.float32(scale)
        if softcap:
            scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
        positions = np.arange(length - (end - start), length)
        if len(alibi_slopes):
            distance = np.arange(length)[None, :] - positions[:, None]
            scores = scores + np.float32(alibi_slopes).reshape(kv_heads, group, 1, 1) * distance.astype(np.float32)
        visible = np.arange(length)[None, :] <= positions[:, None]
        if sliding_window:
            visible &= np.arange(length)[None, :] > positions[:, None] - sliding_window
        scores = np.where(visible, scores, np.finfo(np.float32).min)
        if len(sinks):  # a column of its own, dropped after the softmax
            column = np.broadcast_to(np.float32(sinks).reshape(kv_heads, group, 1, 1), scores.shape[:-1] + (1,))
            scores = np.concatenate([scores, column], axis=-1)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = (scores / scores.sum(axis=-1, keepdims=True))[..., :length]
        context = np.matmul(probs, values[:, None]).reshape(q.shape[1], end - start, -1)
        out[start:end] = context.transpose(1, 0, 2)
    return out


# ---- the fast kernels ------------------------------------------------------------------------------

def paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window: int = 0,
                    softcap: float = 0.0, alibi_slopes=NO_SLOPES, sinks=NO_SLOPES):
    """The numba kernel: same contract as `paged_attention_reference`, pages read in place."""
    check_paged_metadata(query_start_loc, seq_lens, block_tables, (), key_cache.shape[0], key_cache.shape[2], q.shape[0],
                         stores=False)
    check_heads(q.shape[1], key_cache, q.shape[2])
    batch = PagedBatch.of(query_start_loc, seq_lens, block_tables, np.zeros(0, np.int64))
    out = np.empty_like(q)
    _attend(batch, q, key_cache, value_cache, scale, out, sliding_window, softcap, _slopes(alibi_slopes), _slopes(sinks))
    return out


def _slopes(values) -> np.ndarray:
    """The numba kernels' per-head operand (ALiBi's slopes, the sinks): float32, empty for none."""
    return np.asarray(values, np.float32) if len(values) else NO_SLOPES


def _attend(batch: "PagedBatch", q, key_cache, value_cache, scale, out, window: int = 0, softcap: float = 0.0,
            slopes: np.ndarray = NO_SLOPES, sinks: np.ndarray = NO_SLOPES) -> None:
    kernels = _numba_kernels()
    kernel = kernels._attend_parallel if batch.parallel else kernels._attend_serial
    kernel(q, key_cache, value_cache, batch.block_tables, batch.token_seq, batch.positions, np.int64(window),
           np.float32(scale), np.float32(softcap), slopes, sinks, out)


@dataclass
class PagedBatch:
    """A step's attention metadata, converted and split once for all the layers of the step.

    `decode` (one query per sequence) sends a layer through one numba call, `_decode_step` (or its
    parallel twin, with `parallel`: enough work to pay for numba's threads). With `flash` (the artifact's
    `--enable_flash_attention`), sequences with at least FLASH_MIN_QUERIES new tokens attend through
    `flash_prefill`; the others (decodes, short chunks), and all without `flash`, through the numba
    kernel, as the sub-batch `short` of rows `short_rows`.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    token_seq: np.ndarray  # the sequence each query row belongs to
    positions: np.ndarray  # each query row's position in its sequence
    parallel: bool
    decode: bool = False
    flash: list[int] = field(default_factory=list)
    short: "PagedBatch | None" = None
    short_rows: np.ndarray | None = None

    @classmethod
    def of(cls, query_start_loc, seq_lens, block_tables, slot_mapping, flash: bool = False) -> "PagedBatch":
        starts = np.asarray(query_start_loc, np.int64)
        lengths = np.diff(starts)
        seq_lens = np.asarray(seq_lens, np.int64)
        tables = np.asarray(block_tables, np.int64)
        slots = np.asarray(slot_mapping, np.int64)
        long = np.flatnonzero(lengths >= FLASH_MIN_QUERIES).tolist() if flash else []
        if not long:
            token_seq = np.repeat(np.arange(len(lengths)), lengths)
            positions = seq_lens[token_seq] - lengths[token_seq] + np.arange(len(token_seq)) - starts[token_seq]
            decode = len(lengths) > 0 and bool((lengths == 1).all())
            # the kernels are parallel over query rows, so one row alone gains nothing
            parallel = len(token_seq) > 1 and int(np.dot(lengths, seq_lens)) >= PARALLEL_WORK
            return cls(starts, seq_lens, tables, slots, token_seq, positions, parallel, decode)
        none = np.zeros(0, np.int64)
        batch = cls(starts, seq_lens, tables, slots, none, none, False, flash=long)
        short = np.flatnonzero(lengths < FLASH_MIN_QUERIES)
        if len(short):
            batch.short_rows = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in short])
            sub_starts = np.concatenate([[0], np.cumsum(lengths[short])])
            # the sub-batch only attends: the step's keys and values were stored through the whole batch
            batch.short = cls.of(sub_starts, seq_lens[short], tables[short], np.zeros(0, np.int64))
        return batch


def check_paged_metadata(query_start_loc, seq_lens, block_tables, slot_mapping, num_pages: int, page_size: int,
                         tokens: int, stores: bool = True) -> None:
    """Hold a step's metadata to a pool of `num_pages` pages and a step of `tokens` query rows, so no kernel
    indexes outside the arrays it is given: every row in one sequence, each sequence's context covering its
    new rows and covered by its block-table row, the pages it reads and the slots the step writes (with
    `stores`) inside the pool. Raises PagedInputError. Once per step, for all its layers."""
    # as given (int32 or int64): a conversion would copy, and the checks only compare
    starts, contexts, tables, slots = (np.asarray(a) for a in (query_start_loc, seq_lens, block_tables, slot_mapping))
    if any(a.dtype.kind not in "iu" for a in (starts, contexts, tables)) or (stores and slots.dtype.kind not in "iu"):
        raise PagedInputError("attention metadata must be integers")
    if starts.ndim != 1 or len(starts) < 1 or starts[0] != 0 or starts[-1] != tokens:
        raise PagedInputError(f"query_start_loc must run from 0 to the step's {tokens} tokens")
    lengths = np.diff(starts)
    if (lengths < 0).any():
        raise PagedInputError("query_start_loc decreases")
    if contexts.shape != lengths.shape or tables.ndim != 2 or tables.shape[0] != len(lengths):
        raise PagedInputError(f"{len(lengths)} sequences, seq_lens {list(contexts.shape)} and block_tables "
                              f"{list(tables.shape)} do not match")
    if (contexts < lengths).any():
        raise PagedInputError("a sequence's seq_lens is shorter than its new tokens")
    needed = -(-contexts // page_size)
    if len(needed) and int(needed.max()) > tables.shape[1]:
        raise PagedInputError(f"a context of {int(contexts.max())} tokens needs {int(needed.max())} pages, the "
                              f"block tables have {tables.shape[1]}")
    used = tables[np.arange(tables.shape[1])[None, :] < needed[:, None]]
    if used.size and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise PagedInputError(f"a block table names a page outside the pool's {num_pages}")
    if stores:
        if slots.shape != (tokens,):
            raise PagedInputError(f"slot_mapping has shape {list(slots.shape)}, the step has {tokens} tokens")
        if tokens and (int(slots.min()) < 0 or int(slots.max()) >= num_pages * page_size):
            raise PagedInputError(f"a slot is outside the pool's {num_pages * page_size}")


class PagedInputError(ValueError):
    """Attention metadata or operands the kernels cannot take without reading or writing out of bounds."""


def check_heads(num_heads: int, key_cache: np.ndarray, head_dim: int) -> None:
    """The query heads group evenly over the cache's KV heads, of the cache's head size."""
    kv_heads = key_cache.shape[1]
    if num_heads % kv_heads or head_dim != key_cache.shape[3]:
        raise PagedInputError(f"{num_heads} query heads of {head_dim} do not group over the cache's {kv_heads} KV "
                              f"heads of {key_cache.shape[3]}")


def _check_operands(query, key, value, cos, sin, kv_cache, layer, num_heads, kv_num_heads, head_dim) -> None:
    """The projections, rotary tables and the pool's layer as the node's attributes describe them."""
    if not 0 <= layer < len(kv_cache.key):
        raise PagedInputError(f"layer {layer} is outside the pool's {len(kv_cache.key)}")
    key_cache = kv_cache.key[layer]
    if key_cache.shape[1] != kv_num_heads:
        raise PagedInputError(f"kv_num_heads {kv_num_heads} is not the pool's {key_cache.shape[1]}")
    check_heads(num_heads, key_cache, head_dim)
    if query.ndim != 3 or query.shape[0] != 1:
        raise PagedInputError(f"query has shape {list(query.shape)}, not [1, tokens, width]")
    packed = key is None
    width = (num_heads + 2 * kv_num_heads) * head_dim if packed else num_heads * head_dim
    operands = [("query", query, width)] if packed else [("query", query, width), ("key", key, kv_num_heads * head_dim),
                                                          ("value", value, kv_num_heads * head_dim)]
    for name, array, columns in operands:
        if array is None or array.shape != (1, query.shape[1], columns):
            raise PagedInputError(f"{name} has shape {None if array is None else list(array.shape)}, the node's heads "
                                  f"make [1, {query.shape[1]}, {columns}]")
    if cos is not None:
        rotary = cos.shape[-1]
        rows = cos.size // rotary if rotary else 0
        if sin is None or sin.shape != cos.shape or rotary > head_dim or rotary % 2 or rows not in (1, query.shape[1]):
            raise PagedInputError(f"cos/sin of shape {list(cos.shape)} do not fit {query.shape[1]} tokens of head_dim "
                                  f"{head_dim}")


# ---- the node --------------------------------------------------------------------------------------

@register_kernel(PAGED_ATTENTION, host=True)
def PagedAttention(query, key, value, cos, sin, query_start_loc, seq_lens, block_tables, slot_mapping, *,
                   num_heads: int, kv_num_heads: int, head_dim: int, scale: float, rotary_interleaved: int,
                   sliding_window: int, softcap: float, alibi_slopes, sinks, layer: int, page_size: int, flash: int,
                   run: HostRun) -> np.ndarray:
    """Rotate, store the new keys and values in layer `layer` of `run.kv_cache`, attend; returns `[1, T, Hq·D]`.

    `flash` sends long prompt chunks through `flash_prefill` (never set with a `sliding_window`, a `softcap`,
    `alibi_slopes` or `sinks`: flash_prefill attends causally, uncapped, unbiased, sinkless). The metadata is
    prepared once per run (`PagedBatch.of`) for all the layers; `run.fast=False` runs the numpy references.
    `page_size` is the pool's, restated.
    """
    del page_size
    _check_operands(query, key, value, cos, sin, run.kv_cache, layer, num_heads, kv_num_heads, head_dim)
    key_cache, value_cache = run.kv_cache.key[layer], run.kv_cache.value[layer]
    memo = ("PagedBatch", bool(flash))
    batch = run.shared.get(memo)
    if batch is None:
        check_paged_metadata(query_start_loc, seq_lens, block_tables, slot_mapping, key_cache.shape[0],
                             key_cache.shape[2], query.shape[1])
        batch = run.shared[memo] = PagedBatch.of(query_start_loc, seq_lens, block_tables, slot_mapping,
                                                 flash=bool(flash))
    slopes, sinks = _slopes(alibi_slopes), _slopes(sinks)
    if run.fast and batch.decode:
        return _decode(query, key, value, cos, sin, batch, key_cache, value_cache, num_heads, kv_num_heads, head_dim,
                       scale, rotary_interleaved, sliding_window, softcap, slopes, sinks)
    heads = dict(num_heads=num_heads, kv_num_heads=kv_num_heads, head_dim=head_dim, rotary_interleaved=rotary_interleaved)
    if run.fast:
        q = rotate_and_store(query, key, value, cos, sin, batch.slot_mapping, key_cache, value_cache, **heads)
        out = _fast_attention(batch, q, key_cache, value_cache, scale, sliding_window, softcap, slopes, sinks)
    else:
        q = rotate_and_store_reference(query, key, value, cos, sin, batch.slot_mapping, key_cache, value_cache,
                                       **heads)
        out = paged_attention_reference(q, key_cache, value_cache, batch.query_start_loc, batch.seq_lens,
                                        batch.block_tables, scale, sliding_window, softcap, slopes, sinks)
    return out.reshape(1, q.shape[0], num_heads * head_dim)


def _decode(query, key, value, cos, sin, batch, key_cache, value_cache, num_heads, kv_num_heads, head_dim, scale,
            interleaved, window, softcap, slopes, sinks):
    qsrc, ksrc, kofs, vsrc, vofs = split_heads(query, key, value, num_heads, kv_num_heads, head_dim)
    cos, sin = rotary_tables(cos, sin, qsrc.shape[0])
    out = np.empty((qsrc.shape[0], num_heads, head_dim), np.float32)
    kernels = _numba_kernels()
    kernel = kernels._decode_step_parallel if batch.parallel else kernels._decode_step
    kernel(qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, batch.slot_mapping, batch.seq_lens, batch.block_tables,
           key_cache, value_cache, np.int64(window), np.float32(scale), np.float32(softcap), slopes, sinks, out)
    return out.reshape(1, qsrc.shape[0], num_heads * head_dim)


def _fast_attention(batch: PagedBatch, q, key_cache, value_cache, scale, window: int = 0, softcap: float = 0.0,
                    slopes: np.ndarray = NO_SLOPES, sinks: np.ndarray = NO_SLOPES):
    """Long prompt chunks through flash_prefill, everything else (decodes, short chunks) through numba."""
    out = np.empty_like(q)
    if not batch.flash:
        _attend(batch, q, key_cache, value_cache, scale, out, window, softcap, slopes, sinks)
        return out
    page_size = key_cache.shape[2]
    starts, contexts, tables = batch.query_start_loc, batch.seq_lens, batch.block_tables
    for b in batch.flash:
        start, end, length = int(starts[b]), int(starts[b + 1]), int(contexts[b])
        flash_prefill(q[start:end], key_cache, value_cache, tables[b, :-(-length // page_size)], length, scale,
                      out[start:end])
    if batch.short is not None:
        rows = batch.short_rows
        part = np.empty((len(rows),) + q.shape[1:], q.dtype)
        _attend(batch.short, np.ascontiguousarray(q[rows]), key_cache, value_cache, scale, part, window, softcap,
                slopes, sinks)
        out[rows] = part
    return out
