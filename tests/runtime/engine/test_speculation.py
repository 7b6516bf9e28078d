"""Prompt-lookup drafts: the latest earlier match of the longest n-gram, checked against a brute-force search;
draft lengths that follow how often the lookup guesses right."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.engine.speculation import NgramProposer

pytestmark = pytest.mark.unit


def _brute_force(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + count]
    return []


def test_the_longest_ngram_wins_and_its_latest_match_is_taken():
    proposer = NgramProposer(3)
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # "1 2 3" occurred at 0 (followed by 9 2 3); "2 3" more recently at 4 (followed by 8 7 1)
    assert proposer.propose(0, tokens, 10) == [9, 2, 3]
    assert NgramProposer(3, max_ngram=2).propose(0, tokens, 10) == [8, 7, 1]
    assert proposer.propose(1, tokens, 2) == [9, 2]
    assert proposer.propose(2, [5, 6, 7], 4) == []
    assert NgramProposer(0).propose(3, tokens, 4) == []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_incremental_index_equals_a_fresh_search_at_every_length(max_ngram, min_ngram):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 300).tolist()  # a small alphabet: many repeats
    proposer = NgramProposer(4, max_ngram, min_ngram)  # a new sequence's hit rate allows 4 tokens
    for length in range(1, len(tokens) + 1, 3):
        prefix = tokens[:length]
        assert proposer.propose(7, prefix, 9) == _brute_force(prefix, 4, max_ngram, min_ngram), length


def test_forgetting_a_sequence_drops_its_index():
    proposer = NgramProposer(2)
    proposer.propose(4, [1, 2, 1], 2)
    proposer.forget(4)
    assert proposer.propose(4, [3, 4, 3], 2) == [4, 3]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        NgramProposer(-1)
    with pytest.raises(ValueError):
        NgramProposer(2, max_ngram=1, min_ngram=2)


def test_draft_length_follows_the_hit_rate_of_the_first_guess():
    proposer = NgramProposer(8)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1]  # the lookup always has 8 tokens to offer
    lengths = []
    for _ in range(12):  # every first guess wrong
        lengths.append(len(proposer.propose(0, tokens, 8)))
        proposer.observe(0, -1)
    assert lengths[0] == 4 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
    for _ in range(30):  # every first guess right, drafted or not
        draft = proposer.propose(0, tokens, 8)
        proposer.observe(0, tokens[1])
    assert len(draft) == 8
    proposer.observe(0, -1)  # a token with no lookup before it changes nothing
    assert len(proposer.propose(0, tokens, 8)) == 8
