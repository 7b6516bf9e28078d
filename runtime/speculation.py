"""Prompt-lookup speculation: draft tokens guessed from the sequence's own history, checked by the model.

Batch-1 decode reads every weight once per token, so its speed is the memory's (benchmarks/
decode_floor.py). Verifying k guessed tokens in the same step reads the weights once for up to k + 1
tokens. The guess is the n-gram lookup of vLLM's `ngram` method and llama.cpp's lookup decoding: find the
latest earlier place where the sequence's last n tokens (n from `max_ngram` down to `min_ngram`) occurred,
and propose the tokens that followed there. The engine samples each verified row in turn and keeps going
only while the sample equals the draft (runtime/engine.py), so a request's tokens, greedy or seeded, are
those it would get one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Index:
    """Where each n-gram of a sequence last ended (the position its continuation starts at)."""

    ends: list[dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending before this position are in `ends`


@dataclass
class NgramProposer:
    """Drafts up to `num_tokens` tokens per sequence from its longest matching n-gram."""

    num_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    _indexes: dict[int, _Index] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("num_speculative_tokens must be >= 0 and 1 <= min_ngram <= max_ngram")

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        """Up to `min(limit, num_tokens)` tokens that followed the latest earlier match of `tokens`' tail.

        `tokens` is the sequence's history: between calls for one `seq_id` it only grows (its index is
        extended, not rebuilt).
        """
        count = min(limit, self.num_tokens)
        if count <= 0:
            return []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = _Index([{} for _ in range(self.max_ngram + 1)])
        # index the n-grams ending before the last token, so the tail never finds itself
        for end in range(max(index.indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index.ends[n][tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, len(tokens))
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = index.ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + count]
        return []

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's index."""
        self._indexes.pop(seq_id, None)
