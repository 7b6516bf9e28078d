"""The trial step: a two-token prompt and one token after it, run through a runner as a first request
would run, before any request is accepted. An artifact whose graph onnxruntime builds but cannot run
(a shape one node's contract refuses, a wrong wiring, a logits output of the wrong size) is refused
at load with a code, instead of failing every request that comes."""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.engine.runner import ContiguousRunner, PagedRunner
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.scheduler import ScheduledBatch
from cann_llm.runtime.engine.sequence import Sequence
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import ORT_FAILURES, FeedMismatch
from cann_llm.runtime.kernels.paged_attention import PagedInputError
from cann_llm.runtime.signature import (CONTIGUOUS_INPUTS, PAST_NAME, STATE_NAME, fixed_token_shape, is_carried, is_fixed,
                                       present_name)

PROMPT = [0, 1]


def check_generator(metadata: dict, path: str) -> None:
    """Refuse, with E10055, an artifact the engine cannot generate with: one without `input_ids` in and
    `logits` out, or whose export fixed `input_ids`' batch and sequence axes (an export made without
    dynamic axes runs only the shape it was traced at, while each step of generation feeds another). A
    pipeline's stage is the pipeline's to check: its first stage reads the tokens, its last gives logits, and
    only a paged compile, which refuses fixed shapes, splits."""
    if metadata.get("pipeline"):
        return
    inputs = {value["name"]: value["shape"] for value in metadata["signature"]["inputs"]}
    outputs = {value["name"] for value in metadata["signature"]["outputs"]}
    if "input_ids" not in inputs or "logits" not in outputs:
        raise AtcError("E10055", f"{path} is not a causal LM the engine can run: it needs an input_ids input and a "
                                 f"logits output, and has inputs {sorted(inputs)} and outputs {sorted(outputs)}")
    if (metadata.get("kv_cache") or {}).get("layout") != "paged":  # a paged artifact's inputs are the compiler's
        _check_contiguous_io(metadata["signature"], path)
    unsized = [name for name, shape in inputs.items() if STATE_NAME.match(name) and not is_fixed(shape[1:])]
    if unsized:
        raise AtcError("E10055", f"{path} takes the recurrent state {unsized[0]} without fixing its sizes past the "
                                 f"batch, and the engine makes each sequence's first state from them; export it "
                                 f"again with those axes static (only the batch dynamic)")
    shape = fixed_token_shape(metadata["signature"])
    if shape:
        if "input_ids" in (metadata.get("shape_contract") or {}).get("input_shape", {}):
            fixed, remedy = "atc's --input_shape fixed", "compile it again with -1 or a range for those axes"
        else:
            fixed = "its export fixed (exported without dynamic axes)"
            remedy = "export the model again with them dynamic (docs/exporting.md#fixed-shapes) and compile that"
        raise AtcError("E10055", f"{path} takes input_ids of the one shape {shape} only, which {fixed}, and "
                                 f"generating feeds another length each step, so the batch and sequence axes "
                                 f"must be free: {remedy}")


def _check_contiguous_io(signature: dict, path: str) -> None:
    """Refuse, with E10055, a contiguous artifact with an input the engine does not feed (it feeds
    CONTIGUOUS_INPUTS, the cache `past_key_values.N.key|value` and a hybrid's states `past.N.conv|recurrent`),
    a cache input of one fixed length, or one without its present output, which carries it to the next step."""
    inputs = [value["name"] for value in signature["inputs"]]
    outputs = {value["name"] for value in signature["outputs"]}
    unfed = [name for name in inputs if name not in CONTIGUOUS_INPUTS and not is_carried(name)]
    if unfed:
        raise AtcError("E10055", f"{path} takes inputs the engine does not feed: {', '.join(unfed)} (it feeds "
                                 f"{', '.join(CONTIGUOUS_INPUTS)}, a cache named past_key_values.N.key and "
                                 f".value, given back as present.N.key and .value, and recurrent states named "
                                 f"past.N.conv and past.N.recurrent, given back as present.N.conv and .recurrent)")
    fixed = [(value["name"], value["shape"][2]) for value in signature["inputs"] if PAST_NAME.match(value["name"])
             and len(value["shape"]) == 4 and isinstance(value["shape"][2], int) and value["shape"][2] >= 0]
    if fixed:
        raise AtcError("E10055", f"{path} takes {fixed[0][0]} of the one past length {fixed[0][1]}, which its export "
                                 f"fixed, and the cache grows each step: export it again with that axis dynamic "
                                 f"(TorchScript applies dynamic_axes only to inputs named in input_names)")
    uncarried = [name for name in inputs if is_carried(name) and present_name(name) not in outputs]
    if uncarried:
        raise AtcError("E10055", f"{path} takes the cache input {uncarried[0]} but gives no {present_name(uncarried[0])} "
                                 f"output to carry it to the next step (outputs: {', '.join(sorted(outputs))})")


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
    # FeedMismatch: an input the runner does not feed (the executor names it)
    except ORT_FAILURES + (PagedInputError, FeedMismatch) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        # an export whose trace unrolled a loop compiles (with W10008) and fails here as a damaged copy does
        raise AtcError("E13015", path, f"the graph fails a trial step: {reason} (an artifact atc warned with W10008, "
                                       f"whose export unrolled a loop, fails so too: export it again as that "
                                       f"warning says)") from None
    finally:
        runner.release(seq)
