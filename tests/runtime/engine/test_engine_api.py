"""The Python API as callers use it, vLLM's habits included: what a call that stops waiting leaves behind,
how a stream ends for a request that failed, settings passed as SamplingParams and keywords together,
prompts as numpy ids, and an engine dropped without close()."""

from __future__ import annotations

import asyncio
import copy
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager

import numpy as np
import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm import (AtcError, Conversation, ConversationManager, ConversationSettings, EngineClosed,
                      GenerationFailed, LLMEngine, LongContext, SamplingParams, SettingError, StructuredOutput)

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


@contextmanager
def _held_once_tokens_are_out(engine: LLMEngine, sequences: int = 1):
    """Within it, each step that finds at least `sequences` sequences, every one with a token, waits until the
    gate it yields opens (opened, and the runner put back, on leaving): what a test does meanwhile happens
    while the requests are in flight, however fast the tiny model is. A test that waits for several requests
    to have tokens names their number, or the first one's step would hold the others back."""
    gate, run = threading.Event(), engine.runner.run

    def held(batch):
        if len(batch.seqs) >= sequences and all(seq.output_ids for seq in batch.seqs):
            gate.wait(timeout=60)
        return run(batch)

    engine.runner.run = held
    try:
        yield gate
    finally:
        gate.set()
        engine.runner.run = run


def test_a_cancelled_await_cancels_its_request(engine):
    started = engine.stats.generated_tokens

    async def give_up():
        task = asyncio.ensure_future(engine.generate_async([5] * 10, max_new_tokens=200, temperature=0,
                                                           ignore_eos=True))
        while engine.stats.generated_tokens == started:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with _held_once_tokens_are_out(engine):
        asyncio.run(give_up())
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


def _python(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300, env=env)


EXIT_WHILE_RUNNING = """
import sys
from cann_llm import LLMEngine
engine = LLMEngine(sys.argv[1], max_context_len=4096, kv_cache_pages=64)
request = engine.submit([5] * 10, max_new_tokens=4000, temperature=0, ignore_eos=True)
next(request.iter_text())
print("exiting with the request running", flush=True)
"""


def test_a_process_that_exits_with_a_request_running_exits_cleanly(om):
    """The worker was left inside onnxruntime as the interpreter tore down: most such exits aborted
    ("terminate called without an active exception", exit 134)."""
    for _ in range(3):
        ended = _python(EXIT_WHILE_RUNNING, str(om))
        assert (ended.returncode, ended.stdout) == (0, "exiting with the request running\n"), ended.stderr
        assert "terminate called" not in ended.stderr


FORKED = """
import os, signal, sys
from cann_llm import LLMEngine
engine = LLMEngine(sys.argv[1], max_context_len=256, kv_cache_pages=8)
engine.generate([5, 6], 3, 0)  # the worker thread runs in this process, and a fork does not copy it
child = os.fork()
if child == 0:
    signal.alarm(60)  # a hang ends the child with SIGALRM
    try:
        engine.generate([5, 6], 3, 0)
        os._exit(3)
    except RuntimeError as error:
        print(error, flush=True)
        os._exit(0)
print("parent", engine.generate([5, 6], 3, 0) is not None, os.waitpid(child, 0)[1], flush=True)
"""


def test_an_engine_used_in_a_forked_child_is_refused_not_hung(om):
    ran = _python(FORKED, str(om))
    assert ran.returncode == 0, ran.stderr
    said, parent = ran.stdout.splitlines()
    assert "does not survive fork()" in said and parent == "parent True 0"


def test_a_call_waiting_while_the_engine_closes_raises_engine_closed(om):
    engine = LLMEngine(om, max_context_len=256, kv_cache_pages=8)
    outcomes = {}

    def wait(name, call):
        try:
            outcomes[name] = call()
        except Exception as error:
            outcomes[name] = error

    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with _held_once_tokens_are_out(engine, sequences=3) as gate:
        stream = engine.stream([6] * 10, **long)
        waiting = [threading.Thread(target=wait, args=("generate", lambda: engine.generate([5] * 10, **long))),
                   threading.Thread(target=wait, args=("stream", lambda: "".join(stream))),
                   threading.Thread(target=wait, args=("say", lambda: Conversation(engine).say("hi", **long)))]
        for thread in waiting:
            thread.start()
        while len(engine._requests) < 3 or not all(r.output_ids for r in engine._requests.values()):
            time.sleep(0.01)
        closing = threading.Thread(target=engine.close)
        closing.start()
        while not engine._closed:
            time.sleep(0.001)
        gate.set()
        for thread in [closing, *waiting]:
            thread.join(timeout=60)
    # a text cut short by the closing is never returned as if it were the answer
    assert {name: type(outcome) for name, outcome in outcomes.items()} == dict.fromkeys(outcomes, EngineClosed)
    assert len(outcomes) == 3
    with pytest.raises(EngineClosed):
        engine.submit("x")


def test_a_stream_is_submitted_or_refused_by_the_call(engine):
    with pytest.raises(SettingError, match="empty"):
        engine.stream("")
    started, generated = engine.stats.prompt_tokens, engine.stats.generated_tokens
    with _held_once_tokens_are_out(engine):
        pieces = engine.stream([5, 6, 7], max_new_tokens=200, temperature=0, ignore_eos=True)
        deadline = time.monotonic() + 60
        while engine.stats.generated_tokens == generated and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats.prompt_tokens == started + 3  # running before its first piece is asked for
        del pieces  # dropped unread: its request is cancelled
        gc.collect()
    assert _idle(engine)
    assert engine.stats.generated_tokens - generated < 200


def test_a_finished_requests_text_can_be_read_again_and_ends(engine):
    request = engine.submit([5, 6], max_new_tokens=4, temperature=0, ignore_eos=True)
    text = request.result(timeout=120)
    assert "".join(request.iter_text()) == text
    assert list(request.iter_text()) == []  # the end again, where it blocked for ever

    async def read():
        return [piece async for piece in request.aiter_text()]

    assert asyncio.run(read()) == []


def test_empty_batches_and_bytes_prompts(engine):
    assert engine.generate_batch([]) == []
    with pytest.raises(TypeError, match="not bytes"):
        engine.generate(b"abc", 3, 0)
    with pytest.raises(SettingError, match="no messages"):
        engine.chat([])


def test_an_atc_error_crosses_processes_whole():
    error = AtcError("E13001", "/nope.om", "No such file")
    for copied in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (type(copied), copied.code, copied.message, str(copied)) == (AtcError, error.code, error.message,
                                                                             str(error))


def test_conversation_settings_are_checked_for_their_type_and_range(engine):
    with pytest.raises(TypeError, match="budget_tokens must be an integer"):
        ConversationSettings(budget_tokens="100")
    with pytest.raises(TypeError, match="keep_recent must be an integer"):
        ConversationSettings(keep_recent=1.5)
    with pytest.raises(SettingError) as refused:
        ConversationSettings(summary_tokens=0)
    assert refused.value.setting == "summary_tokens"
    with pytest.raises(SettingError) as refused:  # the reply's length is at fault, not the prompt
        Conversation(engine, ConversationSettings(budget_tokens=64)).say("hi", max_new_tokens=64)
    assert refused.value.setting == "max_new_tokens"


def test_finished_deadlines_are_not_kept(engine):
    far = time.monotonic() + 3600
    for _ in range(300):
        request = engine.submit([5], max_new_tokens=1, temperature=0)
        request.expire_at(far)
        request.result(timeout=120)
    engine.generate([5], 1, 0)  # a turn after the last deadline was posted
    assert len(engine._deadlines) <= 64 + 2
