"""The sampling settings vLLM and OpenAI users pass, on the tiny model through `LLMEngine`: vLLM's
`generate(prompts, SamplingParams)` and its output shape, `n`, log-probabilities against the model's own
logits, OpenAI's penalties, `min_tokens`, `stop_token_ids`, and structured outputs with and without
prompt-lookup drafts."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from conftest import ort_reference
from generation_utils import compile_tiny_chat_model

from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.engine.sampler import apply_output_penalties, draw, process_logits
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.sequence import Sequence, TokenLogprob
from cann_llm.runtime.engine.structured import StructuredOutput
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.signature import io_signature, llm_dimensions

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(om):
    with LLMEngine(om, max_context_len=256, kv_cache_pages=64, max_batch_size=8) as engine:
        yield engine


def test_vllms_call_returns_its_output_shape(engine):
    outputs = engine.generate(["abc", [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.outputs) for o in outputs] == [1, 1] and outputs[1].prompt is None and outputs[0].prompt == "abc"
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    first = outputs[0].outputs[0]
    assert first.text == engine.generate("abc", 6, 0.0, ignore_eos=True) and len(first.token_ids) == 6
    assert first.finish_reason == "length" and first.logprobs is None and outputs[0].metrics[0].output_tokens == 6


def test_n_outputs_are_seeded_apart(engine):
    (output,) = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=3, ignore_eos=True))
    texts = [o.text for o in output.outputs]
    assert [o.index for o in output.outputs] == [0, 1, 2] and len(set(texts)) > 1
    alone = engine.generate("abc", max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert texts[1] == alone  # the i-th is seeded seed + i
    (one_prompt,) = engine.generate("abc", max_tokens=12, temperature=1.0, seed=4, n=3, ignore_eos=True)
    assert [o.text for o in one_prompt.outputs] == texts


def test_a_refused_prompt_in_a_batch_leaves_nothing_running(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(["abc", [5, 10 ** 6]], SamplingParams(max_tokens=200, temperature=0, n=2, ignore_eos=True))
    deadline = time.monotonic() + 60
    while engine.blocks.num_used and time.monotonic() < deadline:  # the cancelled end before the next step
        time.sleep(0.01)
    assert engine.blocks.num_used == 0


def test_logprobs_are_log_softmax_of_the_logits(engine):
    import onnx

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)  # what the engine's artifact was compiled from
    signature = io_signature(onnx.load(str(source), load_external_data=False))
    (output,) = engine.generate(["abc"], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
    ids = list(output.prompt_token_ids)
    for token in output.outputs[0].logprobs:
        row = ort_reference(source, causal_lm_inputs(signature, llm_dimensions(signature), np.asarray([ids], np.int64)))
        row = row["logits"][0, -1].astype(np.float64)
        expected = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert token.token_id == int(np.argmax(row)) and token.logprob == pytest.approx(expected[token.token_id], abs=1e-4)
        assert [t for t, _ in token.top] == list(np.argsort(-expected, kind="stable")[:3])
        np.testing.assert_allclose([lp for _, lp in token.top], np.sort(expected)[::-1][:3], atol=1e-4)
        ids.append(token.token_id)
    assert output.outputs[0].cumulative_logprob == pytest.approx(sum(t.logprob for t in output.outputs[0].logprobs))


def test_openais_penalties():
    logits = np.zeros(6, np.float32)
    out = apply_output_penalties(logits, [1, 1, 1, 4], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(out, [0, -1.25, 0, 0, -0.75, 0])
    assert apply_output_penalties(logits, [], 1.0, 1.0) is logits


def test_a_frequency_penalty_stops_a_greedy_loop(engine):
    plain = engine.generate([[5] * 10], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    penalised = engine.generate([[5] * 10], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                           frequency_penalty=2.0))[0].outputs[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_min_tokens_and_stop_token_ids(engine):
    (free,) = engine.generate(["abc"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop_id = free.outputs[0].token_ids[3]
    (stopped,) = engine.generate(["abc"], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id]))
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[:free.outputs[0].token_ids.index(stop_id) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    (held,) = engine.generate(["abc"], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id],
                                                      min_tokens=10))
    assert stop_id not in held.outputs[0].token_ids[:10]


def test_a_grammar_that_may_only_end_wins_over_min_tokens():
    logits = np.array([3.0, 1.0, 2.0, 0.5], np.float32)
    eos_only = np.array([False, False, False, True])
    assert draw(process_logits(logits, SamplingParams(temperature=0), [], 0, (3,), eos_only),
                SamplingParams(temperature=0), None) == 3
    some = np.array([False, True, False, True])  # another token is allowed: the ban holds
    assert draw(process_logits(logits, SamplingParams(temperature=0), [], 0, (3,), some),
                SamplingParams(temperature=0), None) == 1
    huge = SamplingParams(temperature=6e37)  # however hot, an excluded token is never drawn
    rng = np.random.default_rng(0)
    assert {draw(process_logits(logits, huge, [], 0, (), some), huge, rng) for _ in range(200)} <= {1, 3}
    with pytest.raises(ValueError, match="allows no token"):
        process_logits(logits, SamplingParams(temperature=0), [], 0, (), np.zeros(4, bool))


def test_a_prompt_scored_once_is_not_rescored_when_recomputed():
    seq = Sequence([5, 6, 7, 8], SamplingParams(prompt_logprobs=0), frozenset())
    assert seq.scores_prompt(4) and seq.logit_rows(4) == 4
    seq.prompt_logprobs.extend(TokenLogprob(t, -1.0, ()) for t in (5, 6, 7, 8))
    assert not seq.scores_prompt(4) and seq.logit_rows(4) == 1  # preempted, it recomputes its prompt from 0


@pytest.mark.parametrize("drafts", [0, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_hold_with_and_without_drafts(om, drafts, temperature):
    constraints = {r"[ab]{3}-[0-9]{2}": StructuredOutput(regex=r"[ab]{3}-[0-9]{2}"),
                   r"(yes|no|maybe)": StructuredOutput(choice=("yes", "no", "maybe")),
                   r"\{.*\}": StructuredOutput(json={"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                                     "required": ["k"], "additionalProperties": False})}
    with LLMEngine(om, max_context_len=256, kv_cache_pages=64, num_speculative_tokens=drafts) as engine:
        for pattern, constraint in constraints.items():
            (output,) = engine.generate([[5] * 12], SamplingParams(max_tokens=40, temperature=temperature, seed=3, n=3,
                                                                   structured_output=constraint))
            for choice in output.outputs:
                assert re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop", choice.text


def test_a_grammar_that_does_not_compile_is_refused_before_it_runs(engine):
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.submit("abc", structured_output=StructuredOutput(regex="[a-"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="generate"):
        engine.submit("abc", n=2)


@pytest.mark.parametrize("chunk", [512, 3])
def test_prompt_logprobs_whole_and_in_chunks(om, chunk):
    import onnx

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    signature = io_signature(onnx.load(str(source), load_external_data=False))
    prompt = [5, 9, 2, 7, 7, 3, 11, 4]
    logits = ort_reference(source, causal_lm_inputs(signature, llm_dimensions(signature), np.asarray([prompt], np.int64)))
    rows = logits["logits"][0].astype(np.float64)
    expected = rows - (rows.max(-1, keepdims=True) + np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    with LLMEngine(om, max_context_len=256, kv_cache_pages=64, max_num_batched_tokens=chunk) as engine:
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # its pages now in the prefix cache
        (output,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    scored = output.prompt_logprobs
    assert [t.token_id for t in scored] == prompt and scored[0].logprob is None
    np.testing.assert_allclose([t.logprob for t in scored[1:]], [expected[i, prompt[i + 1]] for i in range(7)], atol=1e-4)
    assert [[i for i, _ in t.top] for t in scored[1:]] == [list(np.argsort(-expected[i], kind="stable")[:2]) for i in range(7)]
