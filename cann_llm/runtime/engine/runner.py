"""Model runners: a scheduled batch in, logits out: one row per sequence, and one more per draft token.

`PagedRunner` drives a paged artifact: the batch's tokens flattened into one row with the attention
metadata, keys and values in the page pool (a hybrid's recurrent states in a `StatePool`).
`ContiguousRunner` drives an artifact with past/present I/O (what any ONNX-style runner can use): each
sequence runs on its own with its own growing cache arrays.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.engine.scheduler import ScheduledBatch
from cann_llm.runtime.engine.sequence import Sequence
from cann_llm.runtime.engine.state_pool import StatePool
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.ops import LAST_POSITIONS, paged_metadata_feeds
from cann_llm.runtime.signature import PAST_NAME, is_carried, present_name


class PagedRunner:
    """Runs batches without padding over `pool`."""

    last_positions = False  # whether the graph reads each token's sequence's last position (a rotary switch)

    def __init__(self, executor: Executor, pool: PagePool):
        self.executor, self.pool = executor, pool
        self.page_size = pool.page_size
        self.last_positions = LAST_POSITIONS in executor.loaded.input_names
        self.states = StatePool(executor.loaded.metadata["signature"])

    def feeds(self, batch: ScheduledBatch) -> dict[str, np.ndarray]:
        """The paged graph's inputs for `batch` (see cann_llm/passes/paged_kv_cache.py).

        Built as Python lists and turned into arrays once: a decode step has one token a sequence, and
        numpy's per-call cost over a few dozen tiny arrays was a tenth of a 135M model's step."""
        page_size = self.page_size
        ids, positions, slots, lengths, wanted, tables, last = [], [], [], [], [], [], []
        starts = [0]
        width = max(len(seq.block_table) for seq in batch.seqs)
        for seq, count in zip(batch.seqs, batch.num_tokens):
            first = seq.num_computed
            table = seq.block_table
            tables.append(table + [0] * (width - len(table)))
            ids += seq.window(first, first + count)
            span = range(first, first + count)
            positions += span
            slots += [table[p // page_size] * page_size + p % page_size for p in span]
            lengths.append(first + count)
            end = starts[-1] + count
            starts.append(end)
            wanted += range(end - seq.logit_rows(count), end)
            if self.last_positions:  # the whole sequence's, not the chunk's (a prompt's chunks rotate alike), nor
                last += [len(seq.token_ids) - 1] * count  # a draft's: the scheduler switches on the accepted
        feeds = {"input_ids": np.array([ids], np.int64), "position_ids": np.array([positions], np.int64),
                 **paged_metadata_feeds(starts, lengths, tables, slots),
                 "logits_indices": np.array(wanted, np.int64)}
        if self.last_positions:
            feeds[LAST_POSITIONS] = np.array([last], np.int64)
        if self.states:
            feeds.update(self.states.feeds(batch.seqs))
        return feeds

    def run(self, batch: ScheduledBatch) -> np.ndarray:
        outputs = self.executor.run(self.feeds(batch), ["logits", *self.states.presents], kv_cache=self.pool)
        if self.states:
            self.states.keep(batch.seqs, outputs)
        return outputs["logits"]

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        """Apply the block manager's copies: (source page, target page, leading tokens)."""
        self.pool.copy(copies)

    def release(self, seq: Sequence) -> None:
        self.states.release(seq.seq_id)  # the pages are the block manager's

    def close(self) -> None:
        """Nothing to stop: the pool and the sessions go with the process (a pipeline's stages do not)."""
        self.states.clear()


class ContiguousRunner:
    """Runs each sequence of a batch alone with its own past; an export without a cache recomputes it all. A
    hybrid's recurrent states (`past.N.conv|recurrent`) are carried as they come: they hold every token
    computed, so such an artifact cannot take back a rejected draft (the engine does not speculate on it)."""

    def __init__(self, executor: Executor, signature: dict, dims: dict):
        self.executor, self.signature, self.dims = executor, signature, dims
        self.has_past = bool(dims.get("kv_cache_io"))
        # each cache input's present output (the load checks that each has one), carried to the next step
        self.carried = {present_name(value["name"]): value["name"] for value in signature["inputs"]
                        if is_carried(value["name"])}
        self._past: dict[int, dict[str, np.ndarray]] = {}

    def run(self, batch: ScheduledBatch) -> np.ndarray:
        rows = []
        for seq, count in zip(batch.seqs, batch.num_tokens):
            past = seq.num_computed if self.has_past else 0
            ids = np.asarray(seq.window(past, seq.num_computed + count), np.int64)[None]
            feeds = causal_lm_inputs(self.signature, self.dims, ids, past)
            if self.has_past and past:
                # the cache may run past `past` by a rejected draft: only the first `past` positions are kept
                feeds.update({name: value[:, :, :past] if PAST_NAME.match(name) else value
                              for name, value in self._past[seq.seq_id].items()})
            outputs = self.executor.run(feeds, ["logits", *self.carried])
            if self.has_past:
                self._past[seq.seq_id] = {past: outputs[present] for present, past in self.carried.items()}
            rows.append(outputs["logits"][0, -seq.logit_rows(count):])
        return np.concatenate(rows)

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        del copies  # one private cache per sequence: nothing is shared

    def release(self, seq: Sequence) -> None:
        self._past.pop(seq.seq_id, None)

    def close(self) -> None:
        self._past.clear()
