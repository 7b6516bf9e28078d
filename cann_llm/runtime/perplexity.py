"""Perplexity of a compiled causal LM on a text, with a sliding window (the method of Hugging Face's guide:
each window scores only the tokens the previous window did not, with up to `window - stride` tokens of
context before them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.feeds import causal_lm_inputs, zero_states
from cann_llm.runtime.ops import LAST_POSITIONS, paged_metadata_feeds
from cann_llm.runtime.progress import Progress


@dataclass
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int


def _token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under its row of logits (float64 log-softmax)."""
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return log_norm - logits[np.arange(len(targets)), targets]


def _window_logits(executor: Executor, signature: dict, dims: dict, ids: list[int]) -> np.ndarray:
    """`[len(ids), vocab]`: every position's logits, from a contiguous artifact or from a paged one (a
    pool just big enough for the window, every row's logits asked for)."""
    if not executor.loaded.paged:
        chunk = np.asarray([ids], dtype=np.int64)
        return executor.run(causal_lm_inputs(signature, dims, chunk), ["logits"])["logits"][0]
    count, page_size = len(ids), executor.loaded.kv_cache["page_size"]
    pages = -(-count // page_size)
    pool = PagePool.of(dims, pages, page_size)
    rows = np.arange(count, dtype=np.int64)
    feeds = {"input_ids": np.asarray([ids], np.int64), "position_ids": rows[None],
             **paged_metadata_feeds([0, count], [count], np.arange(pages)[None], rows), "logits_indices": rows,
             **zero_states(signature, 1)}
    if LAST_POSITIONS in executor.loaded.input_names:  # the window is one sequence, `count` long
        feeds[LAST_POSITIONS] = np.full((1, count), count - 1, np.int64)
    return executor.run(feeds, ["logits"], kv_cache=pool)["logits"]


def perplexity(executor: Executor, ids: list[int], window: int = 512, stride: int = 256, *,
               show_progress: bool = False) -> PerplexityResult:
    """exp(mean NLL) of `ids` scored window by window; `show_progress` reports each window on stderr with
    the perplexity so far."""
    metadata = executor.loaded.metadata
    signature, dims = metadata["signature"], metadata["model"]
    return sliding_window_perplexity(lambda chunk: _window_logits(executor, signature, dims, chunk), ids, window,
                                     stride, show_progress=show_progress)


def sliding_window_perplexity(window_logits: Callable[[list[int]], np.ndarray], ids: list[int], window: int = 512,
                              stride: int = 256, *, show_progress: bool = False) -> PerplexityResult:
    """`perplexity` for any model: `window_logits(chunk)` gives `[len(chunk), vocab]`, every position's logits
    with nothing before the chunk (what benchmarks/peers_perplexity.py feeds another runtime's model through)."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError("need window >= 2 and 0 < stride <= window")
    total, count, windows, scored_until = 0.0, 0, 0, 0
    starts = range(0, max(len(ids) - 1, 1), stride)
    # the loop stops at the first window reaching the end of the text
    planned = next((n for n, begin in enumerate(starts, 1) if begin + window >= len(ids)), len(starts))
    with Progress("perplexity", planned, unit="window", enabled=show_progress) as bar:
        for begin in starts:
            end = min(begin + window, len(ids))
            logits = window_logits(ids[begin:end])
            first = max(scored_until, begin + 1)  # the first position not yet scored (position 0 has no context)
            predictions = logits[first - 1 - begin:end - 1 - begin]
            targets = np.asarray(ids[first:end])
            total += float(_token_nll(predictions, targets).sum())
            count += len(targets)
            windows += 1
            scored_until = end
            bar.update(status=f"perplexity {math.exp(total / count):.3f}")
            if end == len(ids):
                break
    return PerplexityResult(math.exp(total / count), count, windows)
