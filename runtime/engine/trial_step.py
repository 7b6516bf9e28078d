"""The trial step: a two-token prompt and one token after it, run through a runner as a first request
would run, before any request is accepted. An artifact whose graph onnxruntime builds but cannot run
(a shape one node's contract refuses, a wrong wiring, a logits output of the wrong size) is refused
at load with a code, instead of failing every request that comes."""

from __future__ import annotations

import numpy as np

from runtime.engine.runner import ContiguousRunner, PagedRunner
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import ScheduledBatch
from runtime.engine.sequence import Sequence
from runtime.errors import AtcError
from runtime.executor import ORT_FAILURES
from runtime.kernels.paged_attention import PagedInputError

PROMPT = [0, 1]


def trial_step(runner: PagedRunner | ContiguousRunner, vocab_size: int, path: str) -> None:
    """Prefill `PROMPT`, then decode one token, through `runner`; its logits must be one row of
    `vocab_size`. A paged runner writes the first pages of its pool, which nothing holds yet. Raises
    AtcError E13015 naming `path` when the artifact cannot run a step."""
    seq = Sequence(list(PROMPT), SamplingParams(max_new_tokens=1, temperature=0.0))
    if isinstance(runner, PagedRunner):
        needed = -(-(len(PROMPT) + 1) // runner.page_size)
        if needed > runner.pool.num_pages:
            return  # a pool this small serves no request either; the scheduler says so per request
        seq.block_table = list(range(needed))
    try:
        for count in (len(PROMPT), 1):
            logits = np.asarray(runner.run(ScheduledBatch([seq], [count])))
            if logits.shape != (1, vocab_size):
                raise AtcError("E13015", path, f"the trial step's logits have shape {list(logits.shape)}, "
                                               f"not [1, {vocab_size}] (one row of the vocabulary)")
            seq.num_computed += count
            seq.token_ids.append(0)
    except ORT_FAILURES + (PagedInputError,) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise AtcError("E13015", path, f"the graph fails a trial step: {reason}") from None
    finally:
        runner.release(seq)
