"""The Python API as callers use it, vLLM's habits included: what a call that stops waiting leaves behind,
how a stream ends for a request that failed, settings passed as SamplingParams and keywords together,
prompts as numpy ids, and an engine dropped without close()."""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
import weakref

import numpy as np
import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm import (Conversation, ConversationManager, GenerationFailed, LLMEngine, LongContext, SamplingParams,
                      SettingError, StructuredOutput)

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if tools %}<tools>{{ tools | length }}{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, TEMPLATE)


@pytest.fixture(scope="module")
def engine(om):
    with LLMEngine(om, max_context_len=256, kv_cache_pages=16) as engine:
        yield engine


def _idle(engine: LLMEngine) -> bool:
    """Whether every request has left the engine and its pages are back (waiting up to a minute)."""
    deadline = time.monotonic() + 60
    while (engine._requests or engine.blocks.num_free != engine.blocks.num_pages) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not engine._requests and engine.blocks.num_free == engine.blocks.num_pages


def test_an_async_reader_whose_loop_closed_leaves_the_engine_working(engine):
    other = engine.submit([5] * 10, max_new_tokens=60, temperature=0, ignore_eos=True)

    async def abandon():
        request = engine.submit([6] * 10, max_new_tokens=60, temperature=0, ignore_eos=True)
        async for _ in request.aiter_text():
            break  # the generator is left open when asyncio.run closes the loop
        return request

    abandoned = asyncio.run(abandon())
    assert other.result(timeout=120) is not None and other.finish_reason == "length"
    assert abandoned.result(timeout=120) is not None
    assert engine._worker.is_alive()
    assert engine.generate([7] * 5, 4, 0) is not None


def _held_once_tokens_are_out(engine: LLMEngine, gate: threading.Event):
    """The runner's run, holding each step that finds every sequence with a token until `gate` opens: what a
    test does meanwhile happens while the requests are in flight, however fast the tiny model is."""
    run = engine.runner.run

    def held(batch):
        if all(seq.output_ids for seq in batch.seqs):
            gate.wait(timeout=60)
        return run(batch)

    return held


def test_a_cancelled_await_cancels_its_request(engine):
    gate, run = threading.Event(), engine.runner.run
    started = engine.stats.generated_tokens

    async def give_up():
        task = asyncio.ensure_future(engine.generate_async([5] * 10, max_new_tokens=200, temperature=0,
                                                           ignore_eos=True))
        while engine.stats.generated_tokens == started:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    engine.runner.run = _held_once_tokens_are_out(engine, gate)
    try:
        asyncio.run(give_up())
    finally:
        gate.set()
        engine.runner.run = run
    assert _idle(engine)
    assert engine.stats.generated_tokens - started < 200


def test_ctrl_c_while_waiting_cancels_the_requests_waited_for(engine):
    # the worker sends SIGINT to the main thread once both requests have tokens, then holds its next step
    # until the interrupt has been handled: generate() is waiting when it lands, however busy the machine
    gate, run, sent = threading.Event(), engine.runner.run, []
    main = threading.main_thread().ident

    def interrupt_once_tokens_are_out(batch):
        if not sent and len(batch.seqs) == 2 and all(seq.output_ids for seq in batch.seqs):
            sent.append(signal.pthread_kill(main, signal.SIGINT))
            gate.wait(timeout=60)
        return run(batch)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = engine.stats.generated_tokens
    engine.runner.run = interrupt_once_tokens_are_out
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate([[5] * 10, [6] * 10], max_new_tokens=200, temperature=0, ignore_eos=True)
    finally:
        gate.set()
        engine.runner.run = run
        signal.signal(signal.SIGINT, previous)
    assert _idle(engine)
    assert engine.stats.generated_tokens - started < 2 * 200  # cancelled, not left to run to max_new_tokens


def test_a_stream_of_a_failed_request_raises(engine):
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    object.__setattr__(params, "top_k", 2.5)  # past the checks, as a fault they do not foresee would be
    with pytest.raises(GenerationFailed):
        list(engine.stream([5, 6, 7], params))


def test_keywords_are_laid_over_a_sampling_params(engine):
    request = engine.submit([5, 6], SamplingParams(max_tokens=3, temperature=0), max_new_tokens=6, ignore_eos=True,
                            logprobs=1)
    request.result(timeout=120)
    assert len(request.output_ids) == 6 and len(request.seq.logprobs) == 6


def test_numpy_ids_are_one_prompt_and_float_ids_are_refused(engine):
    ids = [5, 6, 7]
    expected = engine.generate(ids, 4, 0)
    assert engine.generate(list(np.array(ids)), 4, 0) == expected
    assert engine.generate(np.array(ids), 4, 0) == expected
    with pytest.raises(TypeError, match="token ids are integers, not float"):
        engine.generate([5.0, 6.0], 4, 0)


def test_each_prompt_may_have_its_own_sampling_params(engine):
    outputs = engine.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                                 SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    with pytest.raises(ValueError, match="same length"):
        engine.generate([[5, 6], [7, 8]], [SamplingParams()])
    with pytest.raises(ValueError, match="n > 1 to generate"):
        engine.generate_batch([[5, 6]], n=2)


def test_a_stop_token_id_is_the_stop_reason(engine):
    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = free.token_ids[3]
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_chat_takes_sampling_params_content_parts_and_tools(engine):
    plain = engine.chat([{"role": "user", "content": "hi there"}], SamplingParams(max_tokens=6, temperature=0))
    parts = engine.chat([{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
                        max_new_tokens=6, temperature=0)
    assert parts == plain
    assert engine.tokenizer.decode(engine.chat_prompt([{"role": "assistant", "content": None}])) == "<assistant>\n<assistant>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert engine.tokenizer.decode(engine.chat_prompt([{"role": "user", "content": "x"}], tools)).endswith("<tools>1<assistant>")
    assert engine.chat([{"role": "user", "content": "x"}], tools=tools, max_new_tokens=3, temperature=0) is not None


def test_an_engine_dropped_without_close_is_collected_and_its_worker_ends(om):
    engine = LLMEngine(om, max_context_len=256, kv_cache_pages=4)
    engine.generate([5, 6], 3, 0)
    worker, collected = engine._worker, weakref.ref(engine)
    del engine
    # the worker holds the engine while it finishes its turn: collected once that is over
    deadline = time.monotonic() + 60
    while collected() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert collected() is None
    worker.join(timeout=60)
    assert not worker.is_alive()


def test_embedding_rows_outside_the_table_are_refused(engine):
    assert engine.embed_tokens([0, engine.vocab_size - 1]).shape[0] == 2
    for bad in ([-1], [engine.vocab_size]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.embed_tokens(bad)


@pytest.mark.parametrize("prompt, settings, setting", [
    ("", {}, "prompt"), ([10 ** 9], {}, "prompt"), ("hi \udcff", {}, "prompt"), ("word " * 300, {}, "prompt"),
    ("hi", {"stop_token_ids": [10 ** 9]}, "stop_token_ids"), ("hi", {"logit_bias": {10 ** 9: 1.0}}, "logit_bias"),
    ("hi", {"n": 2}, "n"), ("hi", {"structured_output": StructuredOutput(json='{"type": "bogus"}')}, "structured_output"),
])
def test_a_refusal_names_the_setting_it_is_about(engine, prompt, settings, setting):
    """What a command line names as its flag and a server as its request field."""
    with pytest.raises(SettingError) as refused:
        engine.submit(prompt, **settings)
    assert refused.value.setting == setting
    with pytest.raises(SettingError) as refused:
        Conversation(engine).prompt("word " * 300, 4)
    assert refused.value.setting == "prompt" and "does not fit" in str(refused.value)


def test_a_refused_or_failed_turn_leaves_no_trace_in_the_conversation(engine):
    conversation = Conversation(engine)
    conversation.say("hi", max_new_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="stop token id"):
        conversation.say("hello", max_new_tokens=4, stop_token_ids=[10 ** 9])
    assert [t["role"] for t in conversation.turns] == ["user", "assistant"]
    conversation.say("again", max_new_tokens=4, temperature=0)
    assert [t["role"] for t in conversation.turns] == ["user", "assistant"] * 2
    with pytest.raises(ValueError, match="max_conversations"):
        ConversationManager(engine, max_conversations=0)


def test_an_empty_document_selects_nothing(engine):
    for document in ("", "   \n  "):
        selection = LongContext(engine.tokenizer).select(document, "what?", 100)
        assert selection.chunks == [] or selection.text.strip() == ""
