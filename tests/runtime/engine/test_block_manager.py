"""Page ownership, reference counts, the prefix cache and copy on write."""

from __future__ import annotations

import pytest

from runtime.engine.block_manager import BlockManager
from runtime.engine.sampling import SamplingParams
from runtime.engine.sequence import Sequence

pytestmark = pytest.mark.unit

PAGE = 16


def _seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0))


def _run_prompt(blocks: BlockManager, seq: Sequence) -> None:
    """What the scheduler and engine do for a whole prompt: claim the cached prefix, reserve, compute."""
    blocks.claim_prefix(seq)
    blocks.reserve(seq, len(seq.token_ids))
    seq.num_computed = len(seq.token_ids)
    blocks.register_full_pages(seq)


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
    assert blocks.claim_prefix(second) == 32  # two full pages; the third is still being filled
    assert second.block_table == first.block_table[:2] and second.stats.cached_tokens == 32
    blocks.reserve(second, 42)
    assert blocks.num_used == 3 + 1
    blocks.free(first)
    assert blocks.num_used == 3  # the shared pages are still the second's


def test_the_last_prompt_token_is_always_computed():
    blocks = BlockManager(8, PAGE)
    _run_prompt(blocks, _seq(range(32)))
    again = _seq(range(32))
    assert blocks.claim_prefix(again) == 16  # not 32: the last token's logits are needed


def test_freed_pages_stay_findable_until_the_pool_needs_them():
    blocks = BlockManager(4, PAGE)
    first = _seq(range(33))
    _run_prompt(blocks, first)
    blocks.free(first)
    assert blocks.num_free == 4
    assert blocks.claim_prefix(_seq(range(40))) == 32
    blocks = BlockManager(4, PAGE)
    first = _seq(range(33))
    _run_prompt(blocks, first)
    blocks.free(first)
    _run_prompt(blocks, _seq(range(1000, 1064)))  # needs all four pages: the cached ones are reused
    assert blocks.claim_prefix(_seq(range(40))) == 0


def test_new_tokens_take_blank_freed_pages_then_unused_ones_then_cached_ones():
    blocks = BlockManager(6, PAGE)
    first = _seq(range(40))  # two full pages cached, the third partly filled
    _run_prompt(blocks, first)
    cached, partial = first.block_table[:2], first.block_table[2]
    blocks.free(first)
    second = _seq(range(1000, 1016))  # one page
    _run_prompt(blocks, second)
    assert second.block_table == [partial]  # resident already, nothing cached in it
    third = _seq(range(2000, 2048))  # three pages: the three never used
    _run_prompt(blocks, third)
    assert not set(third.block_table) & {*cached, partial}
    fourth = _seq(range(3000, 3016))
    _run_prompt(blocks, fourth)
    assert fourth.block_table == [cached[1]]  # only now is a cached page given up: a prefix's end first
    assert blocks.claim_prefix(_seq(range(40))) == 16


def test_resetting_the_prefix_cache_forgets_free_pages_only():
    blocks = BlockManager(8, PAGE)
    held, freed = _seq(range(40)), _seq(range(500, 540))
    _run_prompt(blocks, held)
    _run_prompt(blocks, freed)
    blocks.free(freed)
    blocks.reset_prefix_cache()
    assert blocks.claim_prefix(_seq(range(500, 540))) == 0
    assert blocks.claim_prefix(_seq(range(40))) == 32  # still held by a running sequence


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
    assert blocks.pending_copies == [(old_last, child.block_table[1])]
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free == 8
