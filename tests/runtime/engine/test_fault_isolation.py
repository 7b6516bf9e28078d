"""A request that breaks a step fails alone: refused at `submit` when its inputs are out of range, and, when
a fault gets past that, failed inside the step (finish reason "error", `GenerationFailed`, its pages freed)
while the requests batched with it finish exactly as they would alone."""

from __future__ import annotations

import contextlib
import threading

import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm.runtime.engine.engine import GenerationFailed, LLMEngine, Request
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.sequence import Sequence

GOOD = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def engine(om):
    with LLMEngine(om, max_context_len=256, kv_cache_pages=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(engine):
    """The good request's greedy tokens with nothing else in flight."""
    request = engine.submit(GOOD, max_new_tokens=60, temperature=0, ignore_eos=True)
    request.result(timeout=120)
    return request.output_ids


@pytest.mark.parametrize("prompt,kwargs,message", [
    ("vocab", {}, r"token id \d+ is outside the vocabulary \[0, \d+\)"),
    ([4, -1, 4], {}, r"token id -1 is outside the vocabulary"),
    ("a \ud800 b", {}, "not valid UTF-8 \\(a lone surrogate at character 2\\)"),
    ("x" * 100_000, {}, "the prompt has 100000 characters; at most"),
    ([4], {"temperature": float("nan")}, "temperature must be a finite number"),
    ([4], {"top_p": float("inf")}, "top_p must be a finite number"),
    ([4], {"repetition_penalty": 1e-308}, r"repetition_penalty must be in \[0.01, 100\]"),
    ([4], {"temperature": 1e-300}, "temperature must be 0 \\(greedy\\) or at least 0.001"),
    ([4], {"seed": -1}, "seed must be in"),
])
def test_out_of_range_inputs_are_refused_at_submit(engine, prompt, kwargs, message):
    prompt = [4, engine.vocab_size, 4] if prompt == "vocab" else prompt
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, **kwargs)


def _smuggle(engine: LLMEngine, ids: list[int], params: SamplingParams) -> Request:
    """A request past `submit`'s checks, as a fault the checks do not foresee would arrive in a step."""
    request = Request(Sequence(ids, params), None, engine)
    engine._post(("add", request))
    return request


@contextlib.contextmanager
def _held_once(engine: LLMEngine, ready):
    """The first step whose batch satisfies `ready(batch)` waits for the `resume` event this yields (set on
    exit): a request is then still running, with pages, however slowly the test's thread is scheduled."""
    reached, resume, run = threading.Event(), threading.Event(), engine.runner.run

    def held(batch):
        if not resume.is_set() and ready(batch):
            reached.set()
            resume.wait(timeout=120)
        return run(batch)

    engine.runner.run = held
    try:
        yield reached, resume
    finally:
        resume.set()
        engine.runner.run = run


@pytest.mark.parametrize("fault", ["out-of-vocab id", "overflowing penalty"])
def test_a_fault_in_a_step_fails_only_its_request(engine, alone, fault):
    five_out = lambda batch: any(len(seq.output_ids) >= 5 for seq in batch.seqs)  # noqa: E731
    with _held_once(engine, five_out) as (reached, resume):
        good = engine.submit(GOOD, max_new_tokens=60, temperature=0, ignore_eos=True)
        assert reached.wait(timeout=120)  # running, with pages, when the bad one joins its batch
        if fault == "out-of-vocab id":
            bad = _smuggle(engine, [4, engine.vocab_size + 7, 4], SamplingParams(max_new_tokens=8, temperature=0))
        else:
            params = SamplingParams(max_new_tokens=8, temperature=1.0)
            object.__setattr__(params, "repetition_penalty", 1e-308)  # what submit refuses: inf - inf in the sampler
            bad = _smuggle(engine, GOOD[:3], params)
        resume.set()
    with pytest.raises(GenerationFailed, match=f"request {bad.seq.seq_id} failed"):
        bad.result(timeout=120)
    assert bad.finish_reason == "error"
    assert good.result(timeout=120) is not None and good.output_ids == alone and good.finish_reason == "length"
    assert engine.blocks.num_used == 0 and not engine.scheduler.running
    # the engine goes on serving
    again = engine.submit(GOOD, max_new_tokens=60, temperature=0, ignore_eos=True)
    again.result(timeout=120)
    assert again.output_ids == alone
