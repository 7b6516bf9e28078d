"""The paged attention kernels (numba, flash) against their numpy references."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from cann_llm.runtime.kernels import HostRun, host_kernel, is_host_node
from cann_llm.runtime.kernels.paged_attention import (
    PARALLEL_ROTATE_TOKENS,
    PARALLEL_WORK,
    PagedAttention,
    PagedBatch,
    PagedInputError,
    paged_attention,
    paged_attention_reference,
    rotate_and_store,
    rotate_and_store_reference,
)
from cann_llm.runtime.ops import PAGED_ATTENTION, PAGED_METADATA, PagedAttentionInput

PAGE = 16
HEADS, KV_HEADS, DIM = 8, 2, 32


def _pool(pages: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (pages, KV_HEADS, PAGE, DIM)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _scattered_tables(lengths: list[int], pages: int, seed: int = 0) -> np.ndarray:
    """Each sequence's pages drawn without replacement from the pool, in no particular order."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(pages)
    width = max(-(-n // PAGE) for n in lengths)
    tables = np.zeros((len(lengths), width), np.int32)
    used = 0
    for row, n in enumerate(lengths):
        count = -(-n // PAGE)
        tables[row, :count] = order[used:used + count]
        used += count
    return tables


# (new tokens, context length incl. them) per sequence: decodes deep in the cache, a prefill from zero,
# a chunk continuing a cached prompt, a chunk ending exactly on a page boundary
MIXES = [[(1, 300), (1, 17), (1, 1)], [(70, 70), (1, 129), (5, 130)], [(33, 64), (2, 2), (96, 200)]]


def _node(inputs, key_cache, value_cache, fast: bool = True, **attrs):
    """The PagedAttention kernel on one layer's pages (written in place), its attributes' defaults filled."""
    pool = SimpleNamespace(key=key_cache[None], value=value_cache[None])
    return PagedAttention(*inputs, run=HostRun(pool, fast), layer=0, page_size=key_cache.shape[2], **attrs)


def test_paged_attention_is_a_host_kernel_of_the_registry():
    from onnx import helper

    node = helper.make_node(PAGED_ATTENTION.name, [m.name for m in PAGED_METADATA], ["y"], domain="cann")
    assert is_host_node(node) and host_kernel(node).__wrapped__ is PagedAttention.__wrapped__
    assert [m.slot for m in PAGED_METADATA] == list(PagedAttentionInput)[-len(PAGED_METADATA):]


def _batch(mix):
    """(q, key cache, value cache, query_start_loc, seq_lens, block tables, scale) of a step of
    (new tokens, context length) per sequence, over a scattered pool."""
    lengths = [ctx for _, ctx in mix]
    key_cache, value_cache = _pool(64)
    starts = np.concatenate([[0], np.cumsum([q for q, _ in mix])]).astype(np.int32)
    q = np.random.default_rng(1).standard_normal((int(starts[-1]), HEADS, DIM)).astype(np.float32)
    return q, key_cache, value_cache, starts, np.asarray(lengths, np.int32), _scattered_tables(lengths, 64), 0.17


@pytest.mark.parametrize("mix", MIXES, ids=["decodes", "prefill-and-decodes", "chunks"])
def test_numba_and_flash_match_the_reference(mix):
    args = _batch(mix)
    q, key_cache, value_cache, starts, lengths, tables = args[:6]
    expected = paged_attention_reference(*args)
    np.testing.assert_allclose(paged_attention(*args), expected, atol=2e-5, rtol=0)
    batch = PagedBatch.of(starts, lengths, tables, np.zeros(0, np.int64), flash=True)
    from cann_llm.runtime.kernels.paged_attention import _fast_attention

    np.testing.assert_allclose(_fast_attention(batch, q, key_cache, value_cache, 0.17), expected, atol=2e-5, rtol=0)
    assert bool(batch.flash) == any(n >= 64 for n, _ in mix)


@pytest.mark.parametrize("queries,context", [(200, 1300), (1100, 1100), (130, 2049)],
                         ids=["chunk-after-a-key-block", "prompt-over-two-key-blocks", "chunk-over-three"])
def test_flash_prefill_merges_key_blocks_as_the_reference_attends(queries, context):
    """Contexts longer than one key block (FLASH_KEY_BLOCK): the blocks' partial softmaxes are merged."""
    from cann_llm.runtime.kernels.flash_prefill import FLASH_KEY_BLOCK, flash_prefill

    assert context > FLASH_KEY_BLOCK
    pages = -(-context // PAGE)
    key_cache, value_cache = _pool(pages + 3, seed=4)
    table = np.random.default_rng(4).permutation(pages + 3)[:pages]
    q = np.random.default_rng(5).standard_normal((queries, HEADS, DIM)).astype(np.float32)
    out = np.empty_like(q)
    flash_prefill(q, key_cache, value_cache, table, context, 0.17, out)
    expected = paged_attention_reference(q, key_cache, value_cache, np.array([0, queries]), np.array([context]),
                                         table[None], 0.17)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("rotary_dim,interleaved", [(DIM, 0), (DIM, 1), (DIM // 2, 0), (DIM // 2, 1), (0, 0)])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tokens", [7, PARALLEL_ROTATE_TOKENS + 6], ids=["serial", "parallel"])
def test_rotate_and_store_matches_the_reference(rotary_dim, interleaved, packed, tokens):
    rng = np.random.default_rng(2)
    width = (HEADS + 2 * KV_HEADS) * DIM
    qkv = rng.standard_normal((1, tokens, width)).astype(np.float32)
    if packed:
        query, key, value = qkv, None, None
    else:
        query = np.ascontiguousarray(qkv[..., :HEADS * DIM])
        key = np.ascontiguousarray(qkv[..., HEADS * DIM:(HEADS + KV_HEADS) * DIM])
        value = np.ascontiguousarray(qkv[..., (HEADS + KV_HEADS) * DIM:])
    angles = rng.uniform(0, 6.3, (1, 1, tokens, rotary_dim)).astype(np.float32)
    cos, sin = (np.cos(angles), np.sin(angles)) if rotary_dim else (None, None)
    slots = rng.permutation(8 * PAGE)[:tokens].astype(np.int64)  # scattered over the pages
    heads = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, rotary_interleaved=interleaved)
    fast_pool, ref_pool = _pool(8), _pool(8)
    q_fast = rotate_and_store(query, key, value, cos, sin, slots, *fast_pool, **heads)
    q_ref = rotate_and_store_reference(query, key, value, cos, sin, slots, *ref_pool, **heads)
    np.testing.assert_allclose(q_fast, q_ref, atol=1e-6, rtol=0)
    for fast, ref in zip(fast_pool, ref_pool):
        np.testing.assert_allclose(fast, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("flash", [0, 1])
def test_node_kernel_fast_and_reference_agree_and_write_the_same_pages(flash):
    rng = np.random.default_rng(3)
    mix = [(70, 70), (1, 45)]
    lengths = [ctx for _, ctx in mix]
    starts = np.array([0, 70, 71], np.int32)
    tables = _scattered_tables(lengths, 16)
    slots = np.concatenate([tables[0, np.arange(70) // PAGE] * PAGE + np.arange(70) % PAGE,
                            [tables[1, 44 // PAGE] * PAGE + 44 % PAGE]]).astype(np.int64)
    qkv = rng.standard_normal((1, 71, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    inputs = [qkv, None, None, None, None, starts, np.asarray(lengths, np.int32), tables, slots]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, flash=flash)
    fast_pool, ref_pool = _pool(16), _pool(16)
    fast = _node(inputs, *fast_pool, fast=True, **attrs)
    ref = _node(inputs, *ref_pool, fast=False, **attrs)
    assert fast.shape == (1, 71, HEADS * DIM)
    np.testing.assert_allclose(fast, ref, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(fast_pool[0], ref_pool[0])


def _decode_inputs(lengths, pages: int, seed: int = 6):
    rng = np.random.default_rng(seed)
    tables = _scattered_tables(lengths, pages)
    slots = np.array([tables[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lengths)], np.int64)
    qkv = rng.standard_normal((1, len(lengths), (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    return [qkv, None, None, None, None, np.arange(len(lengths) + 1, dtype=np.int32), np.asarray(lengths, np.int32),
            tables, slots]


def _spoil(inputs, slot: PagedAttentionInput, value):
    spoilt = list(inputs)
    spoilt[slot] = value
    return spoilt


# each a step's metadata that would send a kernel outside the pool (8 pages of 16): the message it gets
BAD_METADATA = {
    "slot past the pool": (PagedAttentionInput.SLOT_MAPPING, np.array([8 * PAGE, 3], np.int64), "a slot is outside"),
    "negative slot": (PagedAttentionInput.SLOT_MAPPING, np.array([-1, 3], np.int64), "a slot is outside"),
    "page past the pool": (PagedAttentionInput.BLOCK_TABLES, np.array([[9, 1], [2, 3]], np.int32), "names a page outside"),
    "negative page": (PagedAttentionInput.BLOCK_TABLES, np.array([[0, 1], [-2, 3]], np.int32), "names a page outside"),
    "context past its table": (PagedAttentionInput.SEQ_LENS, np.array([20, 33], np.int32), "needs 3 pages"),
    "context shorter than its tokens": (PagedAttentionInput.SEQ_LENS, np.array([20, 0], np.int32), "shorter than"),
    "rows past the step": (PagedAttentionInput.QUERY_START_LOC, np.array([0, 1, 3], np.int32), "from 0 to the step's 2"),
    "rows running backwards": (PagedAttentionInput.QUERY_START_LOC, np.array([0, 3, 2], np.int32), "decreases"),
}


@pytest.mark.parametrize("fast", [True, False], ids=["numba", "reference"])
@pytest.mark.parametrize("case", BAD_METADATA, ids=list(BAD_METADATA))
def test_metadata_outside_the_pool_is_refused_before_any_page_is_touched(case, fast):
    slot, value, message = BAD_METADATA[case]
    inputs = _spoil(_decode_inputs([20, 17], 8), slot, value)
    key_cache, value_cache = _pool(8)
    before = key_cache.copy(), value_cache.copy()
    with pytest.raises(PagedInputError, match=message):
        _node(inputs, key_cache, value_cache, fast=fast, num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2)
    np.testing.assert_array_equal(key_cache, before[0])
    np.testing.assert_array_equal(value_cache, before[1])


# heads the node's attributes claim against the pool's [pages, 2, 16, 32] and a projection of 8·32 + 2·2·32 columns
BAD_HEADS = {
    "kv heads not the pool's": (dict(kv_num_heads=5), "kv_num_heads 5 is not the pool's 2"),
    "head size not the pool's": (dict(head_dim=16), "do not group over"),
    "query heads not grouping": (dict(num_heads=7), "do not group over"),
    "projection too narrow": (dict(num_heads=10), "query has shape"),
    "layer past the pool": (dict(layer=1), "layer 1 is outside"),
}


@pytest.mark.parametrize("case", BAD_HEADS, ids=list(BAD_HEADS))
def test_attributes_that_do_not_fit_the_arrays_are_refused(case):
    changes, message = BAD_HEADS[case]
    key_cache, value_cache = _pool(8)
    pool = SimpleNamespace(key=key_cache[None], value=value_cache[None])
    attrs = {**dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, layer=0), **changes}
    with pytest.raises(PagedInputError, match=message):
        PagedAttention(*_decode_inputs([20, 17], 8), run=HostRun(pool), page_size=PAGE, **attrs)


def test_the_numba_kernel_refuses_a_block_table_past_the_pool():
    q, key_cache, value_cache, starts, lengths, tables, scale = _batch(MIXES[0])
    tables = tables.copy()
    tables[0, 0] = key_cache.shape[0]
    with pytest.raises(PagedInputError, match="names a page outside"):
        paged_attention(q, key_cache, value_cache, starts, lengths, tables, scale)


def test_flash_prefill_refuses_pages_outside_the_pool():
    from cann_llm.runtime.kernels.flash_prefill import flash_prefill

    key_cache, value_cache = _pool(4)
    q = np.zeros((70, HEADS, DIM), np.float32)
    with pytest.raises(ValueError, match="does not fit its"):
        flash_prefill(q, key_cache, value_cache, np.array([0, 1, 4, 2, 3]), 70, 0.2, np.empty_like(q))
    with pytest.raises(ValueError, match="does not fit its"):
        flash_prefill(q, key_cache, value_cache, np.array([0, 1]), 70, 0.2, np.empty_like(q))


# a batch small enough for the serial decode kernel, and one with enough context for the parallel one
DECODE_BATCHES = [[300, 17, 1, 16], [1500, 17, 700, 1, 64, 129]]


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lengths", DECODE_BATCHES, ids=["serial", "parallel"])
def test_a_decode_step_in_one_call_equals_the_reference(interleaved, packed, lengths):
    rng = np.random.default_rng(5)
    tables = _scattered_tables(lengths, 256)
    slots = np.array([tables[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lengths)], np.int64)
    qkv = rng.standard_normal((1, len(lengths), (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    qkv_inputs = [qkv, None, None] if packed else np.split(qkv, [HEADS * DIM, (HEADS + KV_HEADS) * DIM], axis=-1)
    angles = rng.uniform(0, 6.3, (1, len(lengths), DIM)).astype(np.float32)
    metadata = [np.arange(len(lengths) + 1, dtype=np.int32), np.asarray(lengths, np.int32), tables, slots]
    inputs = [*qkv_inputs, np.cos(angles), np.sin(angles), *metadata]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, rotary_interleaved=interleaved)
    batch = PagedBatch.of(*metadata)
    assert batch.decode and batch.parallel == (sum(lengths) >= PARALLEL_WORK)
    fast_pool, ref_pool = _pool(256), _pool(256)
    fast = _node(inputs, *fast_pool, fast=True, **attrs)
    ref = _node(inputs, *ref_pool, fast=False, **attrs)
    np.testing.assert_allclose(fast, ref, atol=2e-5, rtol=0)
    for fast_cache, ref_cache in zip(fast_pool, ref_pool):
        np.testing.assert_allclose(fast_cache, ref_cache, atol=1e-6, rtol=0)


_PEAK_SCRIPT = """
import sys
import numpy as np
from cann_llm.runtime.kernels.flash_prefill import flash_prefill

length, page, heads, kv_heads, dim = (int(a) for a in sys.argv[1:])
pages = -(-length // page)
rng = np.random.default_rng(4)
key_cache = rng.standard_normal((pages, kv_heads, page, dim)).astype(np.float32)
value_cache = rng.standard_normal((pages, kv_heads, page, dim)).astype(np.float32)
q = rng.standard_normal((length, heads, dim)).astype(np.float32)
out = np.empty_like(q)
flash_prefill(q[:64], key_cache, value_cache, np.arange(pages), 64, 0.2, out[:64])  # the session exists

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
flash_prefill(q, key_cache, value_cache, np.arange(pages), length, 0.2, out)
print((kib("VmHWM") - before) * 1024)
"""


def _flash_peak_bytes(length: int) -> int:
    """Peak resident memory a whole-prompt flash_prefill adds, onnxruntime's included (a fresh process)."""
    args = [str(v) for v in (length, PAGE, HEADS, KV_HEADS, DIM)]
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, *args], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def test_flash_prefill_scratch_memory_does_not_grow_with_the_square_of_the_context():
    small, large = _flash_peak_bytes(2048), _flash_peak_bytes(8192)
    full_scores_large = HEADS * 8192 * 8192 * 4  # 2 GiB
    # 4x the context: a score matrix would grow 16x (the slack is the allocator's, a few blocks of scratch)
    assert large < 2 * small + (32 << 20)
    assert large < full_scores_large / 16


def _decode_step_inputs(q, key_cache, value_cache, starts, lengths, tables) -> list:
    """The PagedAttention node's inputs for a decode step whose new keys and values are the ones the pool
    already holds at each sequence's last position (storing them again changes nothing)."""
    slots = np.array([tables[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lengths)], np.int64)
    k_new = np.stack([key_cache[tables[b, (n - 1) // PAGE], :, (n - 1) % PAGE] for b, n in enumerate(lengths)])
    v_new = np.stack([value_cache[tables[b, (n - 1) // PAGE], :, (n - 1) % PAGE] for b, n in enumerate(lengths)])
    rows = len(lengths)
    return [q.reshape(1, rows, -1), k_new.reshape(1, rows, -1), v_new.reshape(1, rows, -1), None, None, starts,
            np.asarray(lengths, np.int32), tables, slots]


@pytest.mark.parametrize("window", [1, 5, PAGE, PAGE + 1, 40])
@pytest.mark.parametrize("mix", MIXES + [[(1, 300), (1, 41), (1, 7), (1, 16)]],
                         ids=["decodes", "prefill-and-decodes", "chunks", "decode-step"])
def test_a_sliding_window_hides_the_same_keys_in_every_kernel(window, mix):
    """Each query sees the last `window` positions up to its own: the numba kernels (per row and the
    one-call decode step) against the reference, and the reference against the contiguous kernel's mask."""
    from cann_llm.runtime.kernels.attention import attention_mask_bias

    args = _batch(mix)
    q, key_cache, value_cache, starts, lengths, tables = args[:6]
    expected = paged_attention_reference(*args, sliding_window=window)
    assert not np.allclose(expected, paged_attention_reference(*args), atol=1e-3)  # the window hides something
    np.testing.assert_allclose(paged_attention(*args, sliding_window=window), expected, atol=2e-5, rtol=0)
    new, context = mix[0]
    hidden = attention_mask_bias(new, context, None, 1, sliding_window=window)[0, 0] < 0
    positions = np.arange(context - new, context)[:, None]
    np.testing.assert_array_equal(~hidden, (np.arange(context) <= positions) & (np.arange(context) > positions - window))
    if all(n == 1 for n, _ in mix):  # the decode step's own kernel, through the node
        inputs = _decode_step_inputs(q, key_cache, value_cache, starts, lengths, tables)
        got = _node(inputs, key_cache.copy(), value_cache.copy(), num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM,
                    scale=0.17, sliding_window=window)
        np.testing.assert_allclose(got.reshape(q.shape), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mix", MIXES + [[(1, 300), (1, 41), (1, 7), (1, 16)]],
                         ids=["decodes", "prefill-and-decodes", "chunks", "decode-step"])
def test_sinks_join_every_kernels_softmax_alike(mix):
    """gpt-oss's sinks, a logit a head counted in its softmax for no value: the numba kernels (per row and the
    one-call decode step) against the reference, and the reference against the contiguous op's."""
    from cann_llm.runtime.kernels.attention import FusedAttention

    sinks = np.linspace(-1.0, 3.0, HEADS).astype(np.float32)
    args = _batch(mix)
    q, key_cache, value_cache, starts, lengths, tables, scale = args
    expected = paged_attention_reference(*args, sinks=sinks)
    assert not np.allclose(expected, paged_attention_reference(*args), atol=1e-3)  # the sinks take a share
    np.testing.assert_allclose(paged_attention(*args, sinks=sinks), expected, atol=2e-5, rtol=0)
    new, context = mix[0]  # the first sequence through the contiguous op, its context as keys and values
    pages = tables[0, :-(-context // PAGE)]
    keys = key_cache[pages].transpose(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[None, :, :context]
    values = value_cache[pages].transpose(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM)[None, :, :context]
    empty = np.zeros((1, 0, KV_HEADS * DIM), np.float32)
    contiguous, _, _ = FusedAttention(q[:new].reshape(1, new, -1), empty, empty, keys, values, num_heads=HEADS,
                                      kv_num_heads=KV_HEADS, head_dim=DIM, scale=scale, causal=1, rotary_dim=0,
                                      rotary_interleaved=0, bias_per_head=0, bias_is_bool=0, sliding_window=0,
                                      sinks=sinks)
    np.testing.assert_allclose(contiguous.reshape(new, HEADS, DIM), expected[:new], atol=2e-5, rtol=0)
    if all(n == 1 for n, _ in mix):  # the decode step's own kernel, through the node
        inputs = _decode_step_inputs(q, key_cache, value_cache, starts, lengths, tables)
        got = _node(inputs, key_cache.copy(), value_cache.copy(), num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM,
                    scale=scale, sinks=list(sinks))
        np.testing.assert_allclose(got.reshape(q.shape), expected, atol=2e-5, rtol=0)


_STEPS_SCRIPT = """
import numpy as np
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.kernels import HostRun
from cann_llm.runtime.kernels.paged_attention import PagedAttention
from cann_llm.runtime.kernels.warmup import _signatures

heads, kv_heads, dim, page = 8, 2, 32, 16
pool = PagePool([(kv_heads, dim)], 1024, page)
rng = np.random.default_rng(0)
for new, lengths, flash in [([5], [5], 0), ([100], [100], 0), ([100, 1], [100, 40], 1), ([1, 1], [6, 9], 0),
                            ([1] * 6, [1500, 17, 700, 1, 64, 129], 0)]:
    tables = np.arange(len(lengths) * 100, dtype=np.int32).reshape(len(lengths), 100)
    slots = np.concatenate([tables[b, np.arange(n - q, n) // page] * page + np.arange(n - q, n) % page
                            for b, (q, n) in enumerate(zip(new, lengths))])
    starts = np.concatenate([[0], np.cumsum(new)])
    qkv = rng.standard_normal((1, sum(new), (heads + 2 * kv_heads) * dim)).astype(np.float32)
    cos = rng.standard_normal((1, sum(new), dim)).astype(np.float32)
    PagedAttention(qkv, None, None, cos, cos, starts.astype(np.int32), np.asarray(lengths, np.int32), tables,
                   slots.astype(np.int64), num_heads=heads, kv_num_heads=kv_heads, head_dim=dim, scale=0.2, layer=0,
                   page_size=page, flash=flash, run=HostRun(pool))
for kernel, types in _signatures():
    assert kernel.signatures, kernel  # every step kind above reached it
    assert kernel.signatures == [types], (kernel, kernel.signatures, types)
print("ok")
"""


def test_the_warm_up_compiles_the_signatures_a_step_dispatches():
    """A fresh process running every kind of step compiles exactly the warm-up's signatures, no other."""
    done = subprocess.run([sys.executable, "-c", _STEPS_SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-2000:]
