"""`Sequence`: one request's tokens, its place in the KV cache, and its timings."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.structured import Constraint

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """What one request cost: time to first token, tokens in and out, wall time."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    scheduled_s: float | None = None  # seconds after arrival when it first ran (its time in the queue)
    ttft_s: float | None = None
    total_s: float | None = None
    preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds after arrival, one per output token

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.total_s is None or self.output_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the `top` most likely tokens with theirs."""

    token_id: int
    logprob: float | None  # None for a prompt's first token: nothing came before it
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Sequence:
    """A request in flight. `num_computed` tokens have their keys and values in the cache."""

    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    draft: list[int] = field(default_factory=list)  # speculative tokens to verify after the last one
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    constraint: Constraint | None = None  # the structured output's matcher
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt token, when asked for
    # pages are shared only between sequences of one salt: those past a rotary switch are rotated otherwise
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.num_prompt = len(self.token_ids)
        self.stats = RequestStats(prompt_tokens=self.num_prompt)
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def remaining_tokens(self) -> int:
        """New tokens it may still generate."""
        return self.params.max_new_tokens - self.stats.output_tokens

    def scores_prompt(self, count: int) -> bool:
        """Whether a step of `count` tokens from `num_computed` on is a prefill chunk whose every position's
        logits are wanted (for the prompt's log-probabilities)."""
        return (self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt
                and self.num_computed + count <= self.num_prompt)  # once scored, a recompute is not rescored

    def logit_rows(self, count: int) -> int:
        """Logits rows that step needs: each position of a chunk that scores the prompt, else the last,
        plus one per draft token."""
        return count if self.scores_prompt(count) else 1 + len(self.draft)

    @property
    def banned(self) -> tuple[int, ...]:
        """Tokens that may not come next: end-of-sequence before `min_tokens` are out."""
        if self.stats.output_tokens >= self.params.min_tokens or self.params.ignore_eos:
            return ()
        return tuple(self.eos_token_ids) + self.params.stop_token_ids

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def window(self, start: int, stop: int) -> list[int]:
        """Positions `start..stop-1` of the token ids followed by the draft (what a step computes)."""
        ids = self.token_ids[start:stop]
        if stop > len(self.token_ids):
            ids += self.draft[:stop - len(self.token_ids)]
        return ids

    def append(self, token: int) -> None:
        """Add a sampled token; finishes on eos or the length limit."""
        now = time.perf_counter()
        if self.stats.ttft_s is None:
            self.stats.ttft_s = now - self.arrival
        self.stats.token_times.append(now - self.arrival)
        self.token_ids.append(token)
        self.stats.output_tokens += 1
        if (token in self.eos_token_ids and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            self.finish("stop")
        elif self.stats.output_tokens >= self.params.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stats.total_s = time.perf_counter() - self.arrival
