"""The sampler: logits of the scheduled sequences → their next tokens.

Order as in Hugging Face's logits processors: repetition penalty, temperature, top-k, top-p, then a draw
from the request's own seeded generator (so a request's tokens do not depend on its batch-mates).
"""

from __future__ import annotations

import numpy as np

from runtime.engine.sampling import SamplingParams


def apply_repetition_penalty(logits: np.ndarray, seen, penalty: float) -> np.ndarray:
    """CTRL's penalty over the tokens seen so far: positive logits divided by it, negative multiplied."""
    if penalty == 1.0 or not len(seen):
        return logits
    seen = np.asarray(seen)  # the whole history: converted only when a penalty reads it
    out = logits.copy()
    picked = out[seen]
    with np.errstate(all="ignore"):  # an overflow to inf is the caller's to refuse (see sample_token)
        out[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy request draws from, after temperature, top-k and top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < len(scaled):
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        keep = order[:int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(probs, dtype=bool)
        mask[keep] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample_token(logits: np.ndarray, params: SamplingParams, seen, rng: np.random.Generator) -> int:
    """One sequence's next token from its `[vocab]` logits; `seen` is its token history (a list or array)."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits))
    with np.errstate(all="ignore"):  # a distribution that overflowed is refused below, not warned about
        probs = probabilities(logits, params)
    if not np.isfinite(probs).all():
        raise ValueError("the sampling distribution is not finite (the logits overflowed under these settings)")
    return int(rng.choice(len(probs), p=probs))
