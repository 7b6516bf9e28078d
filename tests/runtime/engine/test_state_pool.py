"""StatePool: each sequence's recurrent states between a paged hybrid's steps, handed over without copies for
a step of one sequence and as copied rows for a step of several."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.sequence import Sequence
from cann_llm.runtime.engine.state_pool import StatePool

pytestmark = pytest.mark.unit
SIGNATURE = {"inputs": [{"name": "input_ids", "shape": [1, "num_tokens"], "dtype": "int64"},
                        {"name": "past.0.recurrent", "shape": ["num_seqs", 2, 3], "dtype": "float32"}]}


def _step(pool: StatePool, seqs: list[Sequence], outputs: np.ndarray) -> np.ndarray:
    """One step: the state input fed, the step's outputs kept; returns what was fed."""
    fed = pool.feeds(seqs)["past.0.recurrent"]
    pool.keep(seqs, {"present.0.recurrent": outputs})
    for seq in seqs:
        seq.num_computed += 1
    return fed


def test_rows_pass_alone_without_copies_and_in_a_batch_as_copies():
    pool = StatePool(SIGNATURE)
    a, b = Sequence([1, 2], SamplingParams()), Sequence([3], SamplingParams())
    assert not _step(pool, [a], np.full((1, 2, 3), 1.0, np.float32)).any()  # from zeros
    alone = np.full((1, 2, 3), 2.0, np.float32)
    fed = _step(pool, [a], alone)
    assert (fed == 1.0).all()
    both = np.stack([np.full((2, 3), 3.0, np.float32), np.full((2, 3), 4.0, np.float32)])
    fed = _step(pool, [a, b], both)
    assert (fed[0] == 2.0).all() and not fed[1].any()  # b from zeros beside a's kept row
    assert not np.shares_memory(pool.feeds([a])["past.0.recurrent"], both)
    both[:] = -1.0  # the batch's output written over: each sequence kept a copy of its row
    fed = pool.feeds([b])["past.0.recurrent"]
    assert (fed == 4.0).all() and fed.shape == (1, 2, 3)
    alone_out = np.full((1, 2, 3), 5.0, np.float32)
    pool.keep([b], {"present.0.recurrent": alone_out})
    assert np.shares_memory(pool.feeds([b])["past.0.recurrent"], alone_out)  # a step of one: no copy either way
    assert (pool.feeds([a])["past.0.recurrent"] == 3.0).all()


def test_a_sequence_computed_again_from_its_first_token_starts_from_zeros():
    pool = StatePool(SIGNATURE)
    seq = Sequence([1, 2, 3], SamplingParams())
    _step(pool, [seq], np.full((1, 2, 3), 7.0, np.float32))
    seq.num_computed = 0  # preempted by recompute
    assert not pool.feeds([seq])["past.0.recurrent"].any()
    pool.release(seq.seq_id)
    seq.num_computed = 2
    with pytest.raises(RuntimeError, match="no state held"):
        pool.feeds([seq])
