"""The scheduler: continuous batching under a per-step token budget, chunked prefill, preemption.

Each step it first serves the running sequences by urgency (lowest `priority` first, then arrival; a decode
needs one token, an unfinished prefill its next chunk), then admits waiting ones while the budget,
`max_batch_size` (or the lower `batch_cap` a step-time target sets) and free pages allow: the most urgent
first (a waiting one rises a level for every `priority_aging_s` seconds it has waited, so none starves), ties
by arrival; if the most urgent cannot get its pages yet, none behind it jumps ahead. When pages run out, the
least urgent running sequence (the latest among equals) is preempted by recompute: its pages are freed and it
waits again with its arrival time, ahead of later ones (its pages may still be found in the prefix cache when
it returns). A sequence alone in the batch that still cannot get a page (a prompt longer than the pool, or an
output grown past it) is finished with reason "length"; nothing waits on pages that can never come.
"""

from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

from cann_llm.runtime.engine.block_manager import BlockManager
from cann_llm.runtime.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of its tokens to compute now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Decides which tokens of which sequences each step computes."""

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 priority_aging_s: float = 10.0, rotary_switch: int | None = None):
        self.blocks = blocks
        self.rotary_switch = rotary_switch
        self.priority_aging_s = priority_aging_s
        self.max_batch_size = max_batch_size
        self.batch_cap = max_batch_size  # lowered by the engine's step-time target, if it has one
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Take `seq` out wherever it is and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.finish(reason)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # the most urgent are served (and given pages) first; the last is the first to give its pages up
        self.running.sort(key=lambda s: (s.params.priority, s.arrival))
        budget = self.token_budget
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._crosses_rotary_switch(seq):  # its cache was rotated for a shorter sequence: recomputed
                self._preempt(seq, counted=False)
                continue
            if self.rotary_switch is not None and seq.cache_salt is None:
                # a draft row at position L or later would be verified with the short set, where the model
                # itself would first have switched: drafts stop short of the switch
                del seq.draft[max(0, self.rotary_switch - len(seq.token_ids)):]
            count = self._count(seq, budget)
            if seq.draft and not self.blocks.can_hold(seq, seq.num_computed + count):
                seq.draft.clear()  # a draft never costs another sequence its pages
                count = self._count(seq, budget)
            while not self.blocks.can_hold(seq, seq.num_computed + count):
                if len(self.running) == 1:  # seq alone holds pages (a waiting one holds none)
                    # grown past the whole pool: preempted, it would come back in chunks to this very page
                    self.running.remove(seq)
                    self.blocks.free(seq)
                    seq.finish("length")
                    batch.finished.append(seq)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.reserve(seq, seq.num_computed + count)
                batch.seqs.append(seq)
                batch.num_tokens.append(count)
                budget -= count
                index += 1
        while self.waiting and budget > 0 and len(self.running) < min(self.max_batch_size, self.batch_cap):
            seq = self._most_urgent()
            if not seq.block_table:
                self._crosses_rotary_switch(seq)  # salted first: it may share only pages rotated as it is
                self.blocks.claim_prefix(seq)
            count = min(seq.num_uncomputed, budget)
            if not self.blocks.can_hold(seq, seq.num_computed + count):
                if not self.running and not batch.seqs:
                    # alone with the whole pool and still too long: it can never run
                    self.waiting.remove(seq)
                    self.blocks.free(seq)
                    seq.finish("length")
                    batch.finished.append(seq)
                    continue
                self.blocks.free(seq)
                break
            self.waiting.remove(seq)
            self.blocks.reserve(seq, seq.num_computed + count)
            seq.status = Status.RUNNING
            if seq.stats.scheduled_s is None:
                seq.stats.scheduled_s = time.perf_counter() - seq.arrival
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(count)
            budget -= count
        return batch

    def account(self, batch: ScheduledBatch) -> None:
        """After sampling: count the tokens now in the cache, offer full pages to the prefix cache.

        Everything but the newest token is computed; a rejected draft's keys and values lie beyond that
        and are overwritten by the next step.
        """
        for seq, count in zip(batch.seqs, batch.num_tokens):
            seq.num_computed = min(seq.num_computed + count, len(seq.token_ids) - 1)
            self.blocks.register_pages(seq)

    def retire(self) -> list[Sequence]:
        """Drop finished sequences from the running set, freeing their pages; returns them."""
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.running.remove(seq)
            self.blocks.free(seq)
        return done

    def _crosses_rotary_switch(self, seq: Sequence) -> bool:
        """Whether `seq` has just grown past the model's rotary switch (`rotary_switch_length`: longrope's
        long factors from there on) with keys in its cache rotated the short way. Transformers' Phi-3
        recomputes the whole cache at that point; so does the engine. Salts its pages apart either way."""
        if self.rotary_switch is None or seq.cache_salt is not None or len(seq.token_ids) <= self.rotary_switch:
            return False
        seq.cache_salt = "rotary past its switch"
        return seq.num_computed > 0

    def _most_urgent(self) -> Sequence:
        now = time.perf_counter()
        return min(self.waiting, key=lambda s: (s.params.priority - (now - s.arrival) / self.priority_aging_s,
                                                s.arrival))

    @staticmethod
    def _count(seq: Sequence, budget: int) -> int:
        """Tokens to compute for a running sequence: what is uncomputed, then its draft, within `budget`."""
        count = min(seq.num_uncomputed + len(seq.draft), budget)
        del seq.draft[max(0, count - seq.num_uncomputed):]
        return count

    def _preempt(self, seq: Sequence, counted: bool = True) -> None:
        """Free `seq`'s pages and put it first in line, to be recomputed (`counted` as a preemption unless
        it is a rotary switch's recompute)."""
        seq.draft.clear()
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.stats.preemptions += counted
        self.waiting.appendleft(seq)
