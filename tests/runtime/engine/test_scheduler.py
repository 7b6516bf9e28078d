"""Continuous batching: the token budget, chunked prefill, preemption by recompute, no page leaks."""

from __future__ import annotations

import pytest

from cann_llm.runtime.engine.block_manager import BlockManager
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.scheduler import Scheduler
from cann_llm.runtime.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def _drive(scheduler: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list:
    """Run the scheduler as the engine does, 'sampling' token 7 whenever a sequence's chunk completes it."""
    for seq in seqs:
        scheduler.add(seq)
    batches = []
    while scheduler.has_work():
        batch = scheduler.schedule()
        batches.append(batch)
        for seq, count in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed + count >= len(seq.token_ids) and not seq.finished:
                seq.append(7)
        scheduler.account(batch)
        scheduler.retire()
        assert len(batches) < max_steps
    return batches


def test_the_token_budget_holds_and_long_prompts_are_chunked():
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, max_batch_size=4, max_num_batched_tokens=32)
    seqs = [Sequence(list(range(100 * i, 100 * i + 100)), SamplingParams(max_new_tokens=5)) for i in range(3)]
    batches = _drive(scheduler, seqs)
    assert all(b.total_tokens <= 32 for b in batches)
    assert any(len(b.seqs) > 1 and max(b.num_tokens) > 1 and min(b.num_tokens) == 1 for b in batches)  # mixed
    assert all(s.output_ids == [7] * 5 and s.finish_reason == "length" for s in seqs)
    assert blocks.num_free == 64


def test_running_out_of_pages_preempts_and_every_request_still_finishes():
    blocks = BlockManager(6, 16)
    scheduler = Scheduler(blocks, max_batch_size=8, max_num_batched_tokens=256)
    seqs = [Sequence(list(range(20 * i, 20 * i + 20)), SamplingParams(max_new_tokens=30)) for i in range(4)]
    _drive(scheduler, seqs)
    assert sum(s.stats.preemptions for s in seqs) > 0
    assert all(len(s.output_ids) == 30 for s in seqs)
    assert blocks.num_free == 6


def test_a_request_larger_than_the_whole_pool_ends_instead_of_waiting_forever():
    blocks = BlockManager(2, 16)
    scheduler = Scheduler(blocks, max_batch_size=2, max_num_batched_tokens=64)
    too_long, fits = Sequence(list(range(40)), SamplingParams()), Sequence(list(range(5)), SamplingParams(max_new_tokens=3))
    _drive(scheduler, [too_long, fits])
    assert too_long.finish_reason == "length" and not too_long.output_ids
    assert fits.output_ids == [7, 7, 7]
    assert blocks.num_free == 2


@pytest.mark.parametrize("budget, prefix_caching", [(32, False), (512, False), (32, True)])
def test_an_output_that_outgrows_the_whole_pool_ends_with_length(budget, prefix_caching):
    """Alone, a sequence grows past the pool's 10 pages of 16 tokens (70 prompt tokens, 100 wanted): preempted
    without a prefix cache to take its pages back from (a hybrid's), it would be recomputed in chunks of the
    token budget up to the same page, forever. It ends with what it has."""
    blocks = BlockManager(10, 16, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(blocks, max_batch_size=4, max_num_batched_tokens=budget)
    seq = Sequence(list(range(70)), SamplingParams(max_new_tokens=100))
    _drive(scheduler, [seq], max_steps=500)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 10 * 16 - 70 + 1
    assert blocks.num_free == 10


def test_max_batch_size_caps_the_running_set():
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, max_batch_size=2, max_num_batched_tokens=512)
    batches = _drive(scheduler, [Sequence([1, 2, 3], SamplingParams(max_new_tokens=4)) for _ in range(5)])
    assert max(len(b.seqs) for b in batches) == 2


def test_abort_frees_a_running_sequence():
    blocks = BlockManager(8, 16)
    scheduler = Scheduler(blocks, max_batch_size=2, max_num_batched_tokens=64)
    seq = Sequence(list(range(30)), SamplingParams())
    scheduler.add(seq)
    scheduler.account(scheduler.schedule())
    assert blocks.num_used == 2
    scheduler.abort(seq)
    assert blocks.num_free == 8 and seq.finish_reason == "cancelled" and not scheduler.has_work()


def test_a_draft_is_dropped_rather_than_preempting_another_sequence():
    blocks = BlockManager(2, 4)
    scheduler = Scheduler(blocks, max_batch_size=2, max_num_batched_tokens=64)
    first, second = Sequence([1, 2, 3], SamplingParams()), Sequence([4, 5, 6], SamplingParams())
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    for seq in batch.seqs:
        seq.append(9)
    scheduler.account(batch)
    assert first.num_computed == 3 and first.num_uncomputed == 1
    first.draft = [1, 2, 3]  # positions 3..6: a second page, and none is free
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_tokens == [1, 1] and not batch.preempted
    assert first.draft == []


def test_a_draft_is_trimmed_to_the_token_budget_and_its_kv_rolls_back():
    blocks = BlockManager(8, 4)
    scheduler = Scheduler(blocks, max_batch_size=1, max_num_batched_tokens=3)
    seq = Sequence([1, 2], SamplingParams())
    scheduler.add(seq)
    batch = scheduler.schedule()
    seq.append(3)  # sampled from the prompt's last row
    scheduler.account(batch)
    seq.draft = [4, 5, 6, 7]
    batch = scheduler.schedule()
    assert batch.num_tokens == [3] and seq.draft == [4, 5]
    assert seq.window(seq.num_computed, seq.num_computed + 3) == [3, 4, 5]
    seq.append(4)  # the first draft token accepted, the second rejected and replaced
    seq.append(8)
    scheduler.account(batch)
    assert seq.num_computed == 4 and seq.token_ids == [1, 2, 3, 4, 8] and seq.num_uncomputed == 1


def test_the_most_urgent_is_admitted_first_and_the_least_urgent_preempted():
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(blocks, max_batch_size=2, max_num_batched_tokens=64)
    low, later_low, high = (Sequence([i] * 10, SamplingParams(max_new_tokens=4, priority=p)) for i, p in
                            ((1, 5), (2, 5), (3, -1)))
    for seq in (low, later_low, high):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [high, low]  # then arrival among equals
    # pages run out: the most urgent is served first, the least urgent goes back to waiting
    blocks = BlockManager(3, 16)
    scheduler = Scheduler(blocks, max_batch_size=4, max_num_batched_tokens=64)
    urgent, lax = Sequence([1] * 16, SamplingParams(priority=0)), Sequence([2] * 16, SamplingParams(priority=9))
    _admit_all(scheduler, [lax])
    _admit_all(scheduler, [urgent])  # running since after the other
    urgent.append(7), lax.append(7)  # both need a second page now: only one is left
    batch = scheduler.schedule()
    assert batch.preempted == [lax] and batch.seqs == [urgent]


def test_a_waiting_request_rises_with_the_time_it_waits():
    scheduler = Scheduler(BlockManager(64, 16), max_batch_size=1, max_num_batched_tokens=64, priority_aging_s=1)
    old, fresh = Sequence([1] * 4, SamplingParams(priority=3)), Sequence([2] * 4, SamplingParams(priority=0))
    old.arrival -= 3.5  # waited three and a half levels' worth
    for seq in (fresh, old):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [old]


def _admit_all(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    for seq, count in zip(batch.seqs, batch.num_tokens):
        seq.num_computed += count
    assert {s.seq_id for s in seqs} <= {s.seq_id for s in scheduler.running}


def test_the_batch_cap_follows_the_step_time_target():
    from cann_llm.runtime.engine.batch_control import BatchSizeController

    control = BatchSizeController(target_s=0.020, most=32)
    assert control.observe(0.030, 32, decode_only=True) == 24  # over: a quarter off
    assert control.observe(0.030, 24, decode_only=True) == 18
    assert control.observe(0.500, 18, decode_only=False) == 18  # a prefill chunk says nothing
    assert control.observe(0.018, 18, decode_only=True) == 18  # within 80-100% of the target: kept
    assert control.observe(0.010, 18, decode_only=True) == 19  # well under, and full: one more
    assert control.observe(0.010, 5, decode_only=True) == 19   # under but not full: no need for more
    for _ in range(40):
        control.observe(0.001, control.cap, decode_only=True)
    assert control.cap == 32
    for _ in range(40):
        control.observe(1.0, control.cap, decode_only=True)
    assert control.cap == 1
