"""Perplexity of a compiled causal LM on a text, with a sliding window (the method of Hugging Face's guide:
each window scores only the tokens the previous window did not, with up to `window - stride` tokens of
context before them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runtime.executor import Executor
from runtime.feeds import causal_lm_inputs


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


def perplexity(executor: Executor, ids: list[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    """exp(mean NLL) of `ids` scored window by window."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError("need window >= 2 and 0 < stride <= window")
    metadata = executor.loaded.metadata
    signature, dims = metadata["signature"], metadata["model"]
    total, count, windows, scored_until = 0.0, 0, 0, 0
    for begin in range(0, max(len(ids) - 1, 1), stride):
        end = min(begin + window, len(ids))
        chunk = np.asarray([ids[begin:end]], dtype=np.int64)
        logits = executor.run(causal_lm_inputs(signature, dims, chunk), ["logits"])["logits"][0]
        first = max(scored_until, begin + 1)  # the first position not yet scored (position 0 has no context)
        predictions = logits[first - 1 - begin:end - 1 - begin]
        targets = np.asarray(ids[first:end])
        total += float(_token_nll(predictions, targets).sum())
        count += len(targets)
        windows += 1
        scored_until = end
        if end == len(ids):
            break
    return PerplexityResult(math.exp(total / count), count, windows)
