"""The sampler: logits of the scheduled sequences → their next tokens.

Order as in vLLM's: the penalties (repetition over prompt and output, presence and frequency over the
output), `min_tokens` (end-of-sequence held off), the structured output's mask, then temperature, top-k,
top-p and a draw from the request's own seeded generator (so a request's tokens do not depend on its
batch-mates). Log-probabilities are the model's own, taken before any of it.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.engine.sampling import SamplingParams

_MASKED = np.float32(3e38)  # twice this is -inf in float32


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


def apply_output_penalties(logits: np.ndarray, output, presence: float, frequency: float) -> np.ndarray:
    """OpenAI's penalties over the generated tokens: `presence` off each token generated at least once,
    `frequency` times the number of times it was."""
    if (presence == 0.0 and frequency == 0.0) or not len(output):
        return logits
    tokens, counts = np.unique(np.asarray(output), return_counts=True)
    out = logits.copy()
    out[tokens] -= presence + frequency * counts
    return out


def process_logits(logits: np.ndarray, params: SamplingParams, seen, num_prompt: int,
                   banned=(), allowed: np.ndarray | None = None) -> np.ndarray:
    """The logits a token is drawn from: penalised by `seen` (the sequence's tokens, its first
    `num_prompt` the prompt), `banned` tokens and those outside `allowed` (booleans) set to -inf (the ban
    lifted where the grammar allows nothing else)."""
    if params.penalised:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        logits = apply_output_penalties(logits, seen[num_prompt:], params.presence_penalty, params.frequency_penalty)
        if params.logit_bias:
            tokens, bias = zip(*params.logit_bias)
            logits = np.array(logits, np.float32)
            logits[list(tokens)] += np.asarray(bias, np.float32)
    if allowed is not None:
        if not allowed.any():
            raise ValueError("the structured output allows no token here")
        if int(np.count_nonzero(allowed)) <= sum(bool(allowed[t]) for t in set(banned)):
            banned = ()  # the grammar may only end here: it wins over min_tokens
        # arithmetic, not a boolean index: over a scattered mask that was ten times slower (benchmarks/
        # structured_outputs.py). The floor is doubled past float32's range to -inf: a finite one would come
        # back within reach of the rest once divided by a huge temperature
        floor = (allowed.view(np.uint8).astype(np.float32) - 1) * _MASKED
        with np.errstate(over="ignore"):
            floor += floor
        logits = floor + logits
    if len(banned):
        logits = np.array(logits, np.float32)
        logits[list(banned)] = -np.inf
    return logits


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log_softmax of the model's logits at `token`, and the `top` most likely tokens with theirs."""
    row = np.asarray(logits, np.float64)
    peak = row.max()
    log_total = peak + np.log(np.exp(row - peak).sum())
    best = []
    if top:
        picked = np.argpartition(-row, top - 1)[:top]
        best = [(int(t), float(row[t] - log_total)) for t in picked[np.argsort(-row[picked], kind="stable")]]
    return float(row[token] - log_total), best


def sample_token(logits: np.ndarray, params: SamplingParams, seen, rng: np.random.Generator,
                 num_prompt: int = 0) -> int:
    """One sequence's next token from its `[vocab]` logits; `seen` is its token history (a list or array),
    its first `num_prompt` the prompt."""
    return draw(process_logits(logits, params, seen, num_prompt), params, rng)


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from processed logits: the most likely when greedy, else a draw."""
    if params.greedy:
        return int(np.argmax(logits))
    with np.errstate(all="ignore"):  # a distribution that overflowed is refused below, not warned about
        probs = probabilities(logits, params)
    if not np.isfinite(probs).all():
        raise ValueError("the sampling distribution is not finite (the logits overflowed under these settings)")
    return int(rng.choice(len(probs), p=probs))
