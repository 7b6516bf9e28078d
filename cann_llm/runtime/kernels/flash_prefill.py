"""`flash_prefill`: a long prompt chunk's causal attention, block by block, on onnxruntime's kernels.

Queries are cut into blocks of FLASH_QUERY_BLOCK, the context into blocks of FLASH_KEY_BLOCK keys read
from the pages; one onnxruntime run per (query block, key block) computes every head's scores with
MLAS's matmul, hides each query's future, and returns the block's row maxima, exponential sums and
weighted values, which are merged across key blocks with the online-softmax rescaling. Scratch memory is
one block of scores per head, whatever the context length. `paged_attention_reference` is its spec.

Why onnxruntime and not numpy: numpy's OpenBLAS here runs AVX2 kernels at half the speed of MLAS's
AVX-512 ones, and its elementwise passes (mask, max, exp, sum) ran one after another in Python; on
SmolLM2 the 512-token prefill's attention took 0.17-0.18 s that way, 0.09-0.12 s this way, and the
sessions of a step share onnxruntime's thread pool instead of competing with it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from cann_llm.runtime.ort_session import process_thread_pool_enabled, session_options

FLASH_QUERY_BLOCK = 128
FLASH_KEY_BLOCK = 1024
_HIDDEN = -1e9  # a score no query can see; finite, so a row hidden from a whole block stays a number


@lru_cache(maxsize=1)
def _session() -> ort.InferenceSession:
    """q [KV, G, M, D] (scaled), k_t [KV, 1, D, W], v [KV, 1, W, D], bias [M, W] (0 where a query sees the
    key, _HIDDEN where it does not; every head's the same) -> per row: max m [KV, G, M, 1], sum of
    exp(s - m) l [KV, G, M, 1], and o = exp(s - m) @ v [KV, G, M, D]. The mask comes in as a bias, built outside the graph:
    onnxruntime's broadcasting Where took much of a prompt's time, and a bias built in the graph raised a long
    prefill's peak memory. Keys come transposed from the pages' gather, which copies them anyway, which is
    faster than fusing the transpose into the first product (docs/performance.md#flash-prefill)."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["visible"]),
        helper.make_node("ReduceMax", ["visible"], ["m"], axes=[3], keepdims=1),
        helper.make_node("Sub", ["visible", "m"], ["shifted"]),
        helper.make_node("Exp", ["shifted"], ["p"]),
        helper.make_node("ReduceSum", ["p", "last_axis"], ["l"], keepdims=1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    inputs = [helper.make_tensor_value_info("q", f, ["kv", "g", "m", "d"]),
              helper.make_tensor_value_info("k_t", f, ["kv", 1, "d", "w"]),
              helper.make_tensor_value_info("v", f, ["kv", 1, "w", "d"]),
              helper.make_tensor_value_info("bias", f, ["m", "w"])]
    outputs = [helper.make_tensor_value_info(name, f, None) for name in ("m", "l", "o")]
    constants = [helper.make_tensor("last_axis", TensorProto.INT64, [1], [3])]
    graph = helper.make_graph(nodes, "flash_block", inputs, outputs, constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = session_options()
    # blocks come and go in sizes that depend on the context: give their memory back after each run
    options.enable_cpu_mem_arena = False
    if not process_thread_pool_enabled():
        # a pool of its own that kept spinning after its run would hold a core the next segment needs
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@lru_cache(maxsize=1)
def _bias_source() -> np.ndarray:
    """`[FLASH_QUERY_BLOCK, 2·FLASH_KEY_BLOCK + FLASH_QUERY_BLOCK]`: _HIDDEN where column > row + FLASH_KEY_BLOCK.
    Every block's causal bias is a window of it (`_causal_bias`), so none is computed per block (np.where
    over each block cost a fifth of a short prompt's flash time: docs/performance.md#flash-prefill)."""
    rows = np.arange(FLASH_QUERY_BLOCK)[:, None]
    columns = np.arange(2 * FLASH_KEY_BLOCK + FLASH_QUERY_BLOCK)[None]
    return np.where(columns > rows + FLASH_KEY_BLOCK, np.float32(_HIDDEN), np.float32(0))


def _causal_bias(rows: int, width: int, shift: int) -> np.ndarray:
    """`[rows, width]`: query i sees key k iff k <= i + shift (contiguous, as onnxruntime takes it)."""
    shift = min(shift, width)  # from here on every key is seen anyway
    start = FLASH_KEY_BLOCK - shift
    return np.ascontiguousarray(_bias_source()[:rows, start:start + width])


def _context_block(cache: np.ndarray, pages: np.ndarray, width: int, transposed: bool = False) -> np.ndarray:
    """`[KV, width, D]` (`[KV, D, width]` if `transposed`): the first `width` rows of `pages`, per KV head,
    contiguous."""
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    rows = cache[pages].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :width]
    return np.ascontiguousarray(rows.transpose(0, 2, 1) if transposed else rows)


def flash_prefill(q, key_cache, value_cache, pages, length, scale, out):
    """One sequence's query rows q `[S, Hq, D]` (the last S of its `length` tokens) attend causally over
    its pages (`pages`: its block-table row); writes `out` `[S, Hq, D]`. Raises ValueError for operands that
    do not fit each other (numpy and onnxruntime would refuse them too, less clearly)."""
    kv_heads, page_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    queries_total, num_heads = q.shape[0], q.shape[1]
    if q.ndim != 3 or num_heads % kv_heads or q.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(f"queries {list(q.shape)} and out {list(out.shape)} do not fit the cache's {kv_heads} KV heads "
                         f"of {head_dim}")
    used = np.asarray(pages[:-(-length // page_size)])
    if not queries_total <= length <= len(pages) * page_size or (used.size and not 0 <= used.min() <= used.max()
                                                                  < key_cache.shape[0]):
        raise ValueError(f"a context of {length} tokens ({queries_total} new) does not fit its {len(pages)} pages "
                         f"of the pool's {key_cache.shape[0]}")
    group = num_heads // kv_heads
    offset = length - queries_total
    key_pages = max(1, FLASH_KEY_BLOCK // page_size)
    session = _session()
    # the first key block is read by every query block: gathered from the pages once (only it is kept, so
    # scratch stays bounded whatever the context length)
    first_block = (_context_block(key_cache, pages[:key_pages], length, transposed=True),
                   _context_block(value_cache, pages[:key_pages], length))
    for first in range(0, queries_total, FLASH_QUERY_BLOCK):
        last = min(first + FLASH_QUERY_BLOCK, queries_total)
        rows = last - first
        # [rows, Hq, D] -> [KV, G, rows, D]: query head h reads KV head h // G
        queries = np.ascontiguousarray((q[first:last] * np.float32(scale)).transpose(1, 0, 2))
        queries = queries.reshape(kv_heads, group, rows, head_dim)
        visible_end = offset + last  # keys past the block's last query are nobody's
        running_max = total = acc = None
        for p0 in range(0, -(-visible_end // page_size), key_pages):
            k0 = p0 * page_size
            chunk = pages[p0:p0 + key_pages]
            width = min(len(chunk) * page_size, visible_end - k0)
            if p0:
                keys = _context_block(key_cache, chunk, width, transposed=True)
                values = _context_block(value_cache, chunk, width)
            else:
                keys, values = first_block
                if width < values.shape[1]:
                    keys, values = np.ascontiguousarray(keys[:, :, :width]), np.ascontiguousarray(values[:, :width])
            # query i of the block (position offset + first + i) sees key k0 + k iff k0 + k <= offset + first + i
            bias = _causal_bias(rows, width, offset + first - k0)
            feeds = {"q": queries, "k_t": keys[:, None], "v": values[:, None], "bias": bias}
            block_max, block_total, block_acc = session.run(None, feeds)
            if acc is None:  # the first key block: every query sees key 0, so no row is all hidden
                running_max, total, acc = block_max, block_total, block_acc
                continue
            new_max = np.maximum(running_max, block_max)
            old_weight, new_weight = np.exp(running_max - new_max), np.exp(block_max - new_max)
            total = total * old_weight + block_total * new_weight
            acc = acc * old_weight + block_acc * new_weight
            running_max = new_max
        acc /= total
        out[first:last] = acc.reshape(num_heads, rows, head_dim).transpose(1, 0, 2)
