"""Page ownership, reference counts, the prefix cache and copy on write."""

from __future__ import annotations

import pytest

from cann_llm.runtime.engine.block_manager import BlockManager
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.sequence import Sequence

pytestmark = pytest.mark.unit

PAGE = 16


def _seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0))


def _run_prompt(blocks: BlockManager, seq: Sequence) -> None:
    """What the scheduler and engine do for a whole prompt: claim the cached prefix, reserve, compute."""
    blocks.claim_prefix(seq)
    blocks.reserve(seq, len(seq.token_ids))
    seq.num_computed = len(seq.token_ids)
    blocks.register_pages(seq)


def test_pages_are_owned_once_and_all_return():
    blocks = BlockManager(8, PAGE)
    seqs = [_seq(range(100 * i, 100 * i + n)) for i, n in enumerate((1, 16, 17, 40))]  # nothing shared
    for seq in seqs:
        _run_prompt(blocks, seq)
    assert [len(s.block_table) for s in seqs] == [1, 1, 2, 3]
    owned = [page for s in seqs for page in s.block_table]
    assert len(owned) == len(set(owned)) == blocks.num_used == 7
    for seq in seqs:
        blocks.free(seq)
    assert blocks.num_free == 8 and blocks.num_used == 0


def test_a_shared_prefix_is_computed_once():
    blocks = BlockManager(8, PAGE)
    first, second = _seq(range(40)), _seq(list(range(40)) + [99, 98])
    _run_prompt(blocks, first)
    # two whole pages shared, and the 8 tokens of the third (still being filled) copied into a page of its own
    assert blocks.claim_prefix(second) == 40 and second.stats.cached_tokens == 40
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert blocks.pending_copies == [(first.block_table[2], second.block_table[2], 8)]
    blocks.reserve(second, 42)
    assert blocks.num_used == 3 + 1
    blocks.free(first)
    assert blocks.num_used == 3  # the shared pages are still the second's
    assert (blocks.prefix_queries, blocks.prefix_hits) == (40 + 42, 40)  # in tokens, as vLLM counts them


def test_a_partial_match_stops_where_the_tokens_differ():
    blocks = BlockManager(8, PAGE)
    first = _seq(range(60))  # three whole pages and 12 tokens
    _run_prompt(blocks, first)
    pages = first.block_table
    blocks.free(first)  # a finished chat turn: its pages stay findable, the partly filled one too
    follow_up = _seq([*range(37), 500, *range(38, 60)])  # differs at token 37, inside the third page
    assert blocks.claim_prefix(follow_up) == 37
    assert follow_up.block_table[:2] == pages[:2]
    assert blocks.pending_copies == [(pages[2], follow_up.block_table[2], 5)]
    other = _seq([*range(32), 900, 901])  # nothing registered after the second page starts with 900
    assert blocks.claim_prefix(other) == 32


def test_a_copy_for_a_sequence_that_is_freed_is_dropped():
    blocks = BlockManager(8, PAGE)
    _run_prompt(blocks, _seq(range(20)))
    waiting = _seq(range(24))
    assert blocks.claim_prefix(waiting) == 20 and len(blocks.pending_copies) == 1
    blocks.free(waiting)  # (what the scheduler does when the pool cannot hold it yet)
    assert blocks.pending_copies == [] and blocks.num_used == 2


def test_the_last_prompt_token_is_always_computed():
    blocks = BlockManager(8, PAGE)
    _run_prompt(blocks, _seq(range(32)))
    again = _seq(range(32))
    assert blocks.claim_prefix(again) == 31  # not 32: the last token's logits are needed


def test_freed_pages_stay_findable_until_the_pool_needs_them():
    blocks = BlockManager(4, PAGE)
    first = _seq(range(33))
    _run_prompt(blocks, first)
    blocks.free(first)
    assert blocks.num_free == 4
    assert blocks.claim_prefix(_seq(range(40))) == 33
    blocks = BlockManager(4, PAGE)
    first = _seq(range(33))
    _run_prompt(blocks, first)
    blocks.free(first)
    _run_prompt(blocks, _seq(range(1000, 1064)))  # needs all four pages: the cached ones are reused
    assert blocks.claim_prefix(_seq(range(40))) == 0


def test_new_tokens_take_blank_pages_before_cached_ones():
    blocks = BlockManager(6, PAGE)
    first = _seq(range(40))  # two full pages and a partly filled one, all findable once freed
    _run_prompt(blocks, first)
    cached, partial = first.block_table[:2], first.block_table[2]
    blocks.free(first)
    second = _seq(range(2000, 2048))  # three pages: the three never used
    _run_prompt(blocks, second)
    assert not set(second.block_table) & {*cached, partial}
    third = _seq(range(3000, 3016))
    _run_prompt(blocks, third)
    assert third.block_table == [partial]  # only now is a cached page given up: a prefix's end first
    assert blocks.claim_prefix(_seq(range(40))) == 32


def test_resetting_the_prefix_cache_forgets_free_pages_only():
    blocks = BlockManager(8, PAGE)
    held, freed = _seq(range(40)), _seq(range(500, 540))
    _run_prompt(blocks, held)
    _run_prompt(blocks, freed)
    blocks.free(freed)
    blocks.reset_prefix_cache()
    assert blocks.claim_prefix(_seq(range(500, 540))) == 0
    assert blocks.claim_prefix(_seq(range(40))) == 39  # still held by a running sequence


def test_a_forked_sequence_copies_the_shared_page_it_writes():
    blocks = BlockManager(8, PAGE)
    parent = _seq(range(20))
    _run_prompt(blocks, parent)
    child = _seq(range(20))
    blocks.fork(parent, child)
    assert child.block_table == parent.block_table
    assert blocks.pages_needed(child, 21) == 1
    blocks.reserve(child, 21)
    shared_full, old_last = parent.block_table
    assert child.block_table[0] == shared_full and child.block_table[1] != old_last
    assert blocks.pending_copies == [(old_last, child.block_table[1], PAGE)]
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free == 8
