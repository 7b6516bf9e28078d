"""Prompt-lookup speculation: draft tokens guessed from the sequence's own history, checked by the model.

Batch-1 decode reads every weight once per token, so its speed is the memory's (benchmarks/
decode_floor.py). Verifying k guessed tokens in the same step reads the weights once for up to k + 1
tokens. The guess is the n-gram lookup of vLLM's `ngram` method and llama.cpp's lookup decoding: find the
latest earlier place where the sequence's last n tokens (n from `max_ngram` down to `min_ngram`) occurred,
and propose the tokens that followed there. The engine samples each verified row in turn and keeps going
only while the sample equals the draft (cann_llm/runtime/engine/engine.py), so a request's tokens, greedy or seeded, are
those it would get one step at a time.

A draft token that is rejected still costs its row in the step, so at temperatures where few guesses hold,
fixed-length drafts make decode slower than none (docs/performance.md#speculation). So the draft's
length adapts per sequence: the lookup's first guess is checked against the token actually sampled
every step, drafted or not, and a draft gets as many tokens as keep the chance of reaching the last one
(hit rate to that power, tokens taken as independent) at least MIN_REACH.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cann_llm.runtime.engine.sequence import Sequence

MIN_REACH = 0.05
HIT_RATE_WEIGHT = 0.2  # of the newest guess in the running hit rate


@dataclass
class _State:
    """One sequence: where each of its n-grams last ended (the position its continuation starts at), and
    how often its lookups guessed right."""

    ends: list[dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending before this position are in `ends`
    guess: int | None = None  # the latest lookup's first token, until the token it guessed is sampled
    hit_rate: float = 0.5


@dataclass
class NgramProposer:
    """Drafts up to `num_tokens` tokens per sequence from its longest matching n-gram."""

    num_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    _states: dict[int, _State] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("num_speculative_tokens must be >= 0 and 1 <= min_ngram <= max_ngram")

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        """The draft for the sequence `tokens`: what followed the latest earlier match of its tail, as many
        tokens as its hit rate warrants, at most `min(limit, num_tokens)`.

        `tokens` is the sequence's history: between calls for one `seq_id` it only grows (its index is
        extended, not rebuilt). Call `observe` with the token sampled next.
        """
        if min(limit, self.num_tokens) <= 0:
            return []
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = _State([{} for _ in range(self.max_ngram + 1)])
        guess = self._lookup(state, tokens)
        state.guess = guess[0] if guess else None
        return guess[:min(limit, draft_length(state.hit_rate, self.num_tokens))]

    def observe(self, seq_id: int, token: int) -> None:
        """The token sampled after the last `propose` for `seq_id`: scores that lookup's first guess."""
        state = self._states.get(seq_id)
        if state is not None and state.guess is not None:
            state.hit_rate += HIT_RATE_WEIGHT * ((token == state.guess) - state.hit_rate)
            state.guess = None

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """`propose` for each sequence (its last token not yet computed), at most its limit."""
        return [self.propose(seq.seq_id, seq.token_ids, limit) for seq, limit in zip(seqs, limits)]

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's state."""
        self._states.pop(seq_id, None)

    def _lookup(self, state: _State, tokens: list[int]) -> list[int]:
        # index the n-grams ending before the last token, so the tail never finds itself
        for end in range(max(state.indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                state.ends[n][tuple(tokens[end - n:end])] = end
        state.indexed = max(state.indexed, len(tokens))
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = state.ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + self.num_tokens]
        return []


def draft_length(hit_rate: float, most: int) -> int:
    """Tokens worth drafting for a sequence whose draft tokens hold at `hit_rate` each: as many as keep the
    chance of reaching the last at least MIN_REACH, at most `most`."""
    length = 0
    while length < most and hit_rate ** (length + 1) >= MIN_REACH:
        length += 1
    return length
