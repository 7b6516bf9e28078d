"""`Server` from plain asyncio, no HTTP: admission and its refusals, the accounting of a completed and a
cancelled request, and the shutdown drain, over a real engine on the tiny model."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm.runtime.engine.config import EngineConfig
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.serving.guard import Guard
from cann_llm.runtime.serving.server import Refusal, Server, ServerSettings
from cann_llm.runtime.serving.stats_line import StatsLines

GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": 0, "seed": None, "repetition_penalty": 1.0, "stop": []}
# a token a step and thousands of steps to go: nothing this long ends by itself while a test looks at it
ENDLESS = {**GREEDY, "max_new_tokens": 3000, "ignore_eos": True}
LONG_PROMPT = "x" * 1000


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def _server(om, tmp_path=None, settings=None, **guard) -> Server:
    audit = str(tmp_path / "audit.jsonl") if tmp_path else None
    engine = EngineConfig(kv_cache_pages=64, max_context_len=4096, max_num_batched_tokens=1)
    server = Server({"tiny": str(om)}, engine, settings or ServerSettings(), Guard(audit_log=audit, **guard))
    server.load()
    assert server.status() == "ok", server.error
    return server


def _count(server: Server, outcome: str) -> float:
    return server.metrics.requests.labels("tiny", outcome)._value.get()


def _later() -> float:
    """A deadline no test here reaches."""
    return time.monotonic() + 600


def _refused(call) -> Refusal:
    with pytest.raises(Refusal) as refusal:
        call()
    return refusal.value


def test_refusals_before_any_work(om, tmp_path):
    unloaded = Server({"tiny": str(om)})
    loading = _refused(lambda: unloaded.start(None, None, "/v1/completions", GREEDY, prompt="hi"))
    assert (loading.status, loading.retry_after_s) == (503, 1)
    block = tmp_path / "block.txt"
    block.write_text("forbidden\n")
    server = _server(om, api_keys=["k"], blocklist=str(block), settings=ServerSettings(max_pending=1))
    try:
        key = "Bearer k"
        assert _refused(lambda: server.start(None, None, "/x", GREEDY, prompt="hi")).status == 401
        assert _refused(lambda: server.start("Bearer nope", None, "/x", GREEDY, prompt="hi")).status == 401
        assert _refused(lambda: server.start(key, "other", "/x", GREEDY, prompt="hi")).status == 404
        blocked = _refused(lambda: server.start(key, None, "/x", GREEDY, messages=[
            {"role": "user", "content": "a Forbidden word"}]))
        assert (blocked.status, blocked.kind) == (400, "content_filter")
        tool = {"type": "function", "function": {"name": "f", "description": "does forbidden things"}}
        called = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"q": "FORBIDDEN"}}}]}
        for messages, tools in (([{"role": "user", "content": "hi"}], [tool]), ([called], None)):
            blocked = _refused(lambda: server.start(key, None, "/x", GREEDY, messages=messages, tools=tools))
            assert (blocked.status, blocked.kind) == (400, "content_filter")
        assert _refused(lambda: server.start(key, None, "/x", GREEDY, prompt="x" * 5000)).status == 400
        running = server.start(key, None, "/x", ENDLESS, prompt=LONG_PROMPT)
        full = _refused(lambda: server.start(key, None, "/x", GREEDY, prompt="hi"))
        assert (full.status, full.retry_after_s) == (429, 1)
        # unknown keys and models never reach an engine; the rest count as rejected
        assert _count(server, "rejected") == 5 and server.pending == {"tiny": 1}
        server.end(running, "client")
        assert _refused(lambda: asyncio.run(server.complete(running))).status == 499
        assert server.pending == {"tiny": 0}
    finally:
        server.close()


def test_a_model_that_fails_to_load_is_reported_not_raised(tmp_path):
    (tmp_path / "broken.om").write_bytes(b"not an artifact")
    server = Server({"broken": str(tmp_path / "broken.om")})
    server.load()
    assert server.status() == "error" and "E13015" in server.error
    refusal = _refused(lambda: server.start(None, None, "/x", GREEDY, prompt="hi"))
    assert refusal.status == 503 and server.error in refusal.message


def test_a_completed_request_is_accounted_once(om, tmp_path):
    server = _server(om, tmp_path, api_keys=["k"], quota_tokens=1000)
    try:
        generation = server.start("Bearer k", None, "/v1/completions", {**GREEDY, "max_new_tokens": 8}, prompt="abc")
        done = asyncio.run(server.complete(generation))
        assert done.finish_reason == "length" and len(done.request.output_ids) == 8
        assert server.pending == {"tiny": 0} and server.in_flight == 0
        assert _count(server, "completed") == 1 and _count(server, "cancelled") == 0
        assert server.guard.used == {"k": 3 + 8}
        [record] = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert (record["status"], record["tokens_in"], record["tokens_out"]) == (200, 3, 8)
    finally:
        server.close()


def test_concurrent_requests_cannot_overdraw_a_quota(om):
    """12 requests at once, each of which may use 10 tokens (a 2-token prompt and 8 to generate), against a
    60-token quota: exactly 6 are admitted, whatever the interleaving, and what they used is what is charged."""
    server = _server(om, api_keys=["k"], quota_tokens=60)
    at_once = threading.Barrier(12)
    admitted, refused = [], []

    def ask() -> None:
        at_once.wait()
        try:
            admitted.append(server.start("Bearer k", None, "/v1/completions",
                                         {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}, prompt="hi"))
        except Refusal as refusal:
            refused.append(refusal)

    try:
        askers = [threading.Thread(target=ask) for _ in range(12)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(timeout=120)
        assert len(admitted) == 6 and sum(g.reserved for g in admitted) == 60
        assert {(r.status, r.kind, r.retry_after_s) for r in refused} == {(429, "insufficient_quota", None)}
        assert len(refused) == 6
        for generation in admitted:
            asyncio.run(server.complete(generation))
        assert server.guard.used == {"k": 60} and _count(server, "rejected") == 6 and _count(server, "completed") == 6
    finally:
        server.close()


def test_unused_reserved_tokens_are_refunded(om):
    server = _server(om, api_keys=["k"], quota_tokens=5000)
    try:
        generation = server.start("Bearer k", None, "/v1/completions", ENDLESS, prompt="abc")
        assert generation.reserved == 3 + 3000 and server.guard.used == {"k": 3003}
        _refused(lambda: asyncio.run(server.complete(generation, _gone_after(generation, 5))))
        assert server.guard.used == {"k": 3 + generation.request.stats.output_tokens}
    finally:
        server.close()


def _gone_after(generation, tokens: int):
    async def gone() -> bool:
        return len(generation.request.output_ids) >= tokens
    return gone


def test_a_request_that_fails_in_a_step_is_a_500_counted_failed_and_hurts_no_other(om, caplog):
    server = _server(om)
    try:
        good = server.start(None, None, "/v1/completions", {**GREEDY, "max_new_tokens": 40, "ignore_eos": True},
                            prompt="hello")
        alone = server.engines["tiny"].generate("hello", max_new_tokens=40, temperature=0, ignore_eos=True)
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        object.__setattr__(params, "repetition_penalty", 1e-308)  # past the checks: inf - inf in the sampler
        [bad] = server._admit("tiny", None, "/v1/completions", (), [5, 6, 7], [params], _later())
        failed = _refused(lambda: asyncio.run(server.complete(bad)))
        assert (failed.status, failed.kind) == (500, "server_error") and bad.request.finish_reason == "error"
        # the operator's log has what the client is not told: which request, and the traceback
        logged = [r for r in caplog.records if r.name == "cann_llm.runtime.engine.engine" and r.levelname == "ERROR"]
        assert logged and logged[0].getMessage() == f"request {bad.request.seq.seq_id} failed" and logged[0].exc_info
        [streamed] = server._admit("tiny", None, "/v1/completions", (), [5, 6, 7], [params], _later())

        async def read():
            return [piece async for piece in server.stream(streamed)]

        assert _refused(lambda: asyncio.run(read())).status == 500  # the route sends it as the last event
        assert asyncio.run(server.complete(good)).text == alone
        assert _count(server, "failed") == 2 and _count(server, "completed") == 1
        assert server.pending == {"tiny": 0} and server.engines["tiny"].blocks.num_used == 0
    finally:
        server.close()


def test_n_choices_are_admitted_together_and_charge_their_prompt_once(om, tmp_path):
    server = _server(om, tmp_path, api_keys=["k"], quota_tokens=100, settings=ServerSettings(max_pending=3))
    params = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True, "seed": 1}
    try:
        # more choices than the server ever runs at once: no wait would let them in
        too_many = _refused(lambda: server.start_choices("Bearer k", None, "/x", params, 4, prompt="abc"))
        over_quota = _refused(lambda: server.start_choices("Bearer k", None, "/x", {**params, "max_new_tokens": 40},
                                                           3, prompt="abc"))
        assert (too_many.status, too_many.param, over_quota.kind) == (400, "n", "insufficient_quota")
        assert server.guard.used.get("k", 0) == 0 and server.pending == {"tiny": 0}
        choices = server.start_choices("Bearer k", None, "/v1/completions", params, 3, prompt="abc")
        assert [g.reserved for g in choices] == [3 + 8, 8, 8] and server.guard.used == {"k": 27}
        assert [g.request.seq.params.seed for g in choices] == [1, 2, 3]
        asyncio.run(server.complete_all(choices))
        assert server.guard.used == {"k": 27} and server.pending == {"tiny": 0}
        assert server.metrics.prompt_tokens.labels("tiny")._value.get() == 3
        records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert [(r["tokens_in"], r["tokens_out"]) for r in records] == [(3, 8), (0, 8), (0, 8)]
    finally:
        server.close()


class _SlowAuditGuard(Guard):
    """An audit log on a slow disk: the server's accounting still runs after the engine's future reads done."""

    def audit(self, *args, **kwargs) -> None:
        time.sleep(0.5)
        super().audit(*args, **kwargs)


def test_an_answer_is_complete_only_once_it_is_accounted(om, tmp_path):
    engine = EngineConfig(kv_cache_pages=64, max_context_len=4096, max_num_batched_tokens=1)
    server = Server({"tiny": str(om)}, engine, ServerSettings(),
                    _SlowAuditGuard(audit_log=str(tmp_path / "audit.jsonl")))
    server.load()
    try:
        generation = server.start(None, None, "/x", {**GREEDY, "max_new_tokens": 2, "ignore_eos": True}, prompt="abc")
        _wait_until(generation.request.future.done)  # the engine's thread is now writing the audit line
        asyncio.run(server.complete(generation))
        assert server.pending == {"tiny": 0} and server.in_flight == 0
        assert len((tmp_path / "audit.jsonl").read_text().splitlines()) == 1
    finally:
        server.close()


def test_a_choice_the_engine_refuses_ends_its_siblings_uncharged(om):
    server = _server(om, api_keys=["k"], quota_tokens=10_000)
    # long enough that no sibling finishes (and is charged) before the third is refused, however busy the host
    good = SamplingParams(max_new_tokens=3000, temperature=0, ignore_eos=True)
    try:
        refusal = _refused(lambda: server._admit("tiny", "k", "/x", (), [5, 6, 7],
                                                 [good, good, SamplingParams(stop_token_ids=(10 ** 6,))], _later()))
        assert (refusal.status, refusal.param) == (400, None) and "outside the vocabulary" in refusal.message
        _wait_until(lambda: server.in_flight == 0)
        assert server.guard.used.get("k", 0) == 0 and server.pending == {"tiny": 0}
        assert _count(server, "rejected") == 1 and _count(server, "cancelled") == 0
        assert server.engines["tiny"].blocks.num_used == 0
    finally:
        server.close()


def test_choices_share_one_deadline_and_a_failing_choice_ends_the_rest(om):
    server = _server(om, settings=ServerSettings(request_timeout_s=0.5))
    try:
        choices = server.start_choices(None, None, "/x", ENDLESS, 2, prompt=LONG_PROMPT)
        assert _refused(lambda: asyncio.run(server.complete_all(choices))).status == 504
        # the tiny model is fast: a choice may finish its 3000 tokens before the deadline
        assert {g.ended_by or g.request.finish_reason for g in choices} <= {"timeout", "length"}
        assert "timeout" in {g.ended_by or g.request.finish_reason for g in choices}
        failing = SamplingParams(max_new_tokens=8, temperature=1.0)
        object.__setattr__(failing, "repetition_penalty", 1e-308)  # past the checks: inf - inf in the sampler
        # the failing choice fails in the first step; the other needs thousands (a token a step). The deadline
        # is not this half's subject: a busy host can take 0.5 s over the 1,000-token prefill alone
        choices = server._admit("tiny", None, "/x", (), [5] * 1000, [failing, SamplingParams(**ENDLESS)], _later())
        assert _refused(lambda: asyncio.run(server.complete_all(choices))).status == 500
        assert [g.outcome()[0] for g in choices] == [500, 500] and choices[1].ended_by == "failed"
        _wait_until(lambda: server.in_flight == 0)
        assert server.engines["tiny"].blocks.num_used == 0
    finally:
        server.close()


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


@pytest.mark.parametrize("prompt,params,message", [
    ([5, 100_000], GREEDY, "token id 100000 is outside the vocabulary"),
    ([-3], GREEDY, "token id -3 is outside the vocabulary"),
    ("a \udc80", GREEDY, "lone surrogate"),
    ("hi", {**GREEDY, "temperature": float("nan")}, "temperature must be a finite number"),
    ("hi", {**GREEDY, "repetition_penalty": 1e-308}, "repetition_penalty must be in"),
])
def test_hostile_inputs_are_400s_before_any_work(om, prompt, params, message):
    server = _server(om)
    try:
        refusal = _refused(lambda: server.start(None, None, "/v1/completions", params, prompt=prompt))
        assert (refusal.status, refusal.kind) == (400, "invalid_request_error") and message in refusal.message
        assert _count(server, "rejected") == 1 and server.pending == {"tiny": 0}
    finally:
        server.close()


def test_a_request_whose_client_left_is_cancelled_and_its_pages_freed(om):
    server = _server(om)
    try:
        generation = server.start(None, None, "/v1/completions", ENDLESS, prompt=LONG_PROMPT)

        async def gone() -> bool:
            return True

        refusal = _refused(lambda: asyncio.run(server.complete(generation, gone)))
        assert refusal.status == 499 and generation.request.finish_reason == "cancelled"
        assert server.pending == {"tiny": 0} and _count(server, "cancelled") == 1
        assert server.engines["tiny"].blocks.num_used == 0
    finally:
        server.close()


def test_a_request_past_its_timeout_gets_504(om):
    server = _server(om, settings=ServerSettings(request_timeout_s=0.01))
    try:
        generation = server.start(None, None, "/v1/completions", ENDLESS, prompt=LONG_PROMPT)
        assert _refused(lambda: asyncio.run(server.complete(generation))).status == 504
        assert server.pending == {"tiny": 0} and _count(server, "cancelled") == 1
    finally:
        server.close()


def test_the_engine_ends_a_request_at_its_deadline_while_the_event_loop_is_blocked(om):
    """The timeout holds on a host too busy to wake the server's loop: the engine ends the request itself."""
    server = _server(om, settings=ServerSettings(request_timeout_s=0.2))
    try:
        generation = server.start(None, None, "/v1/completions", ENDLESS, prompt=LONG_PROMPT)

        async def starved():
            waiting = asyncio.ensure_future(server.complete(generation))
            await asyncio.sleep(0)  # complete_all starts and sets the deadline, then the loop is held
            held_until = time.monotonic() + 60
            while not generation.request.future.done() and time.monotonic() < held_until:
                time.sleep(0.05)
            ended_while_held = generation.request.finish_reason
            with pytest.raises(Refusal) as refusal:
                await waiting
            return ended_while_held, refusal.value.status

        assert asyncio.run(starved()) == ("timeout", 504)
        assert generation.request.stats.output_tokens < ENDLESS["max_new_tokens"]
        assert server.pending == {"tiny": 0} and _count(server, "cancelled") == 1
        assert server.engines["tiny"].blocks.num_used == 0
    finally:
        server.close()


def test_drain_waits_for_what_finishes_within_the_grace_period(om, tmp_path):
    server = _server(om, tmp_path)
    short = server.start(None, None, "/v1/completions", {**GREEDY, "max_new_tokens": 4}, prompt="hi")

    async def shut_down():
        waiting = asyncio.ensure_future(server.complete(short))
        await server.drain(grace_s=600)  # returns as soon as nothing is in flight
        return await waiting

    assert asyncio.run(shut_down()) is short and short.finish_reason == "length"
    assert server.pending == {"tiny": 0} and _count(server, "completed") == 1
    assert [json.loads(line)["status"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()] == [200]
    assert server.status() == "shutting down"
    assert _refused(lambda: server.start(None, None, "/x", GREEDY, prompt="hi")).status == 503


def test_drain_ends_what_is_left_after_the_grace_period_with_503(om, tmp_path):
    server = _server(om, tmp_path)
    endless = server.start(None, None, "/v1/completions", ENDLESS, prompt=LONG_PROMPT)
    streamed = server.start(None, None, "/v1/completions", ENDLESS, prompt=LONG_PROMPT)

    async def read(generation):
        return [piece async for piece in server.stream(generation)]

    async def shut_down():
        waits = [asyncio.ensure_future(server.complete(endless)), asyncio.ensure_future(read(streamed))]
        await server.drain(grace_s=0)
        return await asyncio.gather(*waits, return_exceptions=True)

    ended, stream_end = asyncio.run(shut_down())
    assert isinstance(ended, Refusal) and ended.status == 503 and ended.kind == "unavailable"
    assert isinstance(stream_end, Refusal) and stream_end.status == 503
    assert server.pending == {"tiny": 0} and server.in_flight == 0 and _count(server, "cancelled") == 2
    assert [json.loads(line)["status"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()] == [503, 503]


def test_stats_lines_say_what_changed_and_nothing_when_idle(om):
    server = _server(om)
    try:
        clock = iter(range(100)).__next__
        lines = StatsLines(server.engines, clock=lambda: float(clock()))
        assert lines.lines() == []
        generation = server.start(None, None, "/v1/completions", {**GREEDY, "max_new_tokens": 8}, prompt="abc")
        generation.request.result(timeout=60)
        # 8 tokens between two looks one (fake) second apart
        assert lines.lines() == ["tiny: 0 running, 0 waiting, 8.0 tokens/s, KV pages 0/64"]
        assert lines.lines() == []
    finally:
        server.close()


def test_a_conversation_kept_by_the_server_grows_turn_by_turn(om):
    server = _server(om)
    params = {**GREEDY, "max_new_tokens": 6}
    try:
        first = asyncio.run(server.complete(server.start(None, None, "/x", params, messages=[
            {"role": "user", "content": "hello"}], conversation=("c1", "be kind", "hello"))))
        kept = server.conversations["tiny"].get("c1")
        assert kept.system == "be kind" and kept.turns == [{"role": "user", "content": "hello"},
                                                            {"role": "assistant", "content": first.text}]
        second = server.start(None, None, "/x", params, messages=[{"role": "user", "content": "more"}],
                              conversation=("c1", None, "more"))
        # the prompt is the whole conversation so far, as the model's template renders it
        assert second.request.seq.token_ids[:second.request.seq.num_prompt] == server.engines["tiny"].chat_prompt(
            kept.messages())
        asyncio.run(server.complete(second))
        assert [t["content"] for t in kept.turns][::2] == ["hello", "more"]
        refused = _refused(lambda: server.start(None, None, "/x", {**params, "temperature": -1}, messages=[
            {"role": "user", "content": "y"}], conversation=("c1", None, "y")))
        assert refused.status == 400 and len(kept.turns) == 4  # a refused turn leaves nothing behind
        # a long turn (a token a step, thousands of steps) to look at while it runs
        running = server.start(None, None, "/x", {**ENDLESS, "max_new_tokens": 2000},
                               messages=[{"role": "user", "content": "z" * 500}], conversation=("c1", None, "z" * 500))
        _wait_until(lambda: len(kept.turns) == 5)
        busy = _refused(lambda: server.start(None, None, "/x", params, messages=[{"role": "user", "content": "x"}],
                                             conversation=("c1", None, "x")))
        assert (busy.status, busy.param) == (409, "conversation_id")
        server.end(running, "client")
        _wait_until(lambda: server.in_flight == 0)
        assert len(kept.turns) == 4 and server.conversations["tiny"].lock("c1").acquire(blocking=False)
    finally:
        server.close()


def test_a_request_that_could_outgrow_the_memory_limit_is_refused(om):
    from cann_llm.runtime.memory import resident_bytes

    engine = EngineConfig(kv_cache_pages=4096, max_context_len=4096)  # 128 MiB of pages, mapped lazily
    server = Server({"tiny": str(om)}, engine, ServerSettings())
    server.load()
    try:
        tiny = server.engines["tiny"]
        need = 16 * -(-4002 // tiny.page_size) * tiny.kv_bytes_per_page  # 16 choices of a 2-token prompt + 4000
        assert need >= 16 * 2 ** 20
        limit_mb = server.settings.max_memory_mb = (resident_bytes() + need * 3 // 2) // 2 ** 20
        long = {**GREEDY, "max_new_tokens": 4000}
        first = server.start_choices(None, None, "/x", long, 16, prompt="hi")  # room for one such request ...
        assert sum(g.kv_pages for g in first) * tiny.kv_bytes_per_page == need
        # ... not two: refused
        refusal = _refused(lambda: server.start_choices(None, None, "/x", long, 16, prompt="hi"))
        assert (refusal.status, refusal.kind, refusal.retry_after_s) == (503, "unavailable", 1)
        assert "memory limit" in refusal.message and server.pending == {"tiny": 16}
        small = server.start(None, None, "/x", {**GREEDY, "max_new_tokens": 4}, prompt="hi")  # one page: fits
        for generation in first:
            server.end(generation, "client")
        asyncio.run(server.complete(small))
        _wait_until(lambda: server.in_flight == 0)
        assert resident_bytes() <= limit_mb * 2 ** 20
        # what the ended requests reserved is given back
        again = server.start_choices(None, None, "/x", long, 16, prompt="hi")
        assert len(again) == 16
        for generation in again:
            server.end(generation, "client")
        _wait_until(lambda: server.in_flight == 0)
        # a request that could not fit even with nothing else running is told so, not to retry
        server.settings.max_memory_mb = resident_bytes() // 2 ** 20 + 1
        alone = _refused(lambda: server.start_choices(None, None, "/x", long, 16, prompt="hi"))
        assert (alone.status, alone.param, alone.retry_after_s) == (400, "max_tokens", None)
    finally:
        server.close()


def test_a_memory_limit_bounds_the_kv_pool_so_the_prefix_cache_cannot_lock_the_server_out(om):
    """The prefix cache keeps freed pages resident; under --max-memory the pool holds only the pages the limit
    leaves room for, and a stream of different prompts reuses cached pages instead of writing new ones."""
    from cann_llm.runtime.memory import resident_bytes

    engine = EngineConfig(kv_cache_pages=4096, max_context_len=4096)  # 128 MiB of pages, mapped lazily
    limit_mb = int((resident_bytes() + 48 * 2 ** 20) / 0.9) // 2 ** 20 + 1
    server = Server({"tiny": str(om)}, engine, ServerSettings(max_memory_mb=limit_mb))
    server.load()
    try:
        tiny = server.engines["tiny"]
        pool = tiny.blocks.num_pages
        assert pool < 4096 and resident_bytes() + (pool - tiny.blocks.touched) * tiny.kv_bytes_per_page <= limit_mb * 2 ** 20
        pages_each = -(-(300 + 8) // tiny.page_size)
        rounds = 2 * pool // pages_each + 1  # twice the pool, each prompt its own, all of it cached
        for number in range(rounds):
            generation = server.start(None, None, "/x", {**GREEDY, "max_new_tokens": 8},
                                      prompt=[3 + number % 200] + [5 + (number * 7 + i) % 250 for i in range(299)])
            asyncio.run(server.complete(generation))
        assert tiny.blocks.touched <= pool
    finally:
        server.close()


def test_a_pool_that_would_outgrow_the_machines_memory_is_warned_about_at_start(om, monkeypatch):
    """Mapped lazily, the pool starts small and grows as distinct prompts write it; past the memory the
    machine has, the process would be killed long after a start that went well. Without --max-memory the
    start says so; with it, the pool is cut to fit instead (the test above)."""
    from cann_llm.runtime.serving import server as server_module

    server = Server({"tiny": str(om)}, EngineConfig(kv_cache_pages=4096, max_context_len=4096))  # 128 MiB of pages
    server.load()
    try:
        tiny = server.engines["tiny"]
        growth = (tiny.blocks.num_pages - tiny.blocks.touched) * tiny.kv_bytes_per_page
        for available, warned in ((growth - 2 ** 20, True), (growth + 2 ** 20, False)):
            monkeypatch.setattr(server_module, "available_bytes", lambda: available)
            lines = server.pool_lines()
            assert lines[0].startswith("tiny: KV pool of 4096 pages")
            assert any("--max-memory" in line and line.startswith("warning:") for line in lines) == warned, lines
        server.settings.max_memory_mb = 4096
        monkeypatch.setattr(server_module, "available_bytes", lambda: 2 ** 20)
        assert len(server.pool_lines()) == 1
    finally:
        server.close()


def test_loading_warms_the_engine_up_before_it_says_ready(om):
    server = _server(om)
    try:
        engine = server.engines["tiny"]
        # a batch of two ran (pages written, llguidance's tokenizer built), and the counters start at zero
        assert engine.blocks.touched >= 2 and engine._grammars._tokenizer is not None
        assert engine.blocks.prefix_queries == 0 and engine.stats.generated_tokens == 0
        assert engine.blocks.num_used == 0
    finally:
        server.close()


def test_a_failing_engine_opens_its_circuit_breaker_until_a_probe_succeeds(om, caplog):
    server = _server(om, settings=ServerSettings(breaker_threshold=2, breaker_cooldown_s=30))
    failing = SamplingParams(max_new_tokens=8, temperature=1.0)
    object.__setattr__(failing, "repetition_penalty", 1e-308)  # past the checks: inf - inf in the sampler
    try:
        for _ in range(2):
            [bad] = server._admit("tiny", None, "/x", (), [5, 6, 7], [failing], _later())
            assert _refused(lambda: asyncio.run(server.complete(bad))).status == 500
        _wait_until(lambda: server.in_flight == 0)
        shed = _refused(lambda: server.start(None, None, "/x", GREEDY, prompt="hi"))
        assert (shed.status, shed.kind) == (503, "unavailable") and "failing" in shed.message and shed.retry_after_s >= 1
        assert [r.getMessage() for r in caplog.records if r.name == "cann_llm.runtime.serving.server"] == [
            "model tiny: 2 requests failed in a row; refusing its requests for 30 s"]
        # the cool-down over (moved back rather than waited for: a busy host could take the whole of a short one
        # between the failures and the check above): one request is let through to try the engine
        server.breakers["tiny"].opened_at -= 31
        probe = server.start(None, None, "/x", {**ENDLESS, "max_new_tokens": 2000}, prompt=LONG_PROMPT)
        assert _refused(lambda: server.start(None, None, "/x", GREEDY, prompt="hi")).status == 503
        server.end(probe, "client")  # a probe that says nothing about the engine: the next one is let through
        _wait_until(lambda: server.in_flight == 0)
        good = server.start(None, None, "/x", {**GREEDY, "max_new_tokens": 4}, prompt="hi")
        asyncio.run(server.complete(good))
        _wait_until(lambda: server.in_flight == 0)
        assert not server.breakers["tiny"].is_open  # it completed: closed again
        asyncio.run(server.complete(server.start(None, None, "/x", {**GREEDY, "max_new_tokens": 4}, prompt="hi")))
    finally:
        server.close()


def _long_history(server: Server, conversation_id: str) -> list[dict]:
    """Two exchanges of 1,500 tokens each in `conversation_id` (the byte tokenizer: a character a token), so
    that its next turn must summarise the first: a prompt of about 3,000 tokens, prefilled a token a step."""
    kept = server.conversations["tiny"].get(conversation_id)
    kept.turns = [{"role": role, "content": f"{conversation_id} {role} {turn} " + "a" * 1500}
                  for turn in range(2) for role in ("user", "assistant")]
    return list(kept.turns)


def test_turns_being_summarised_hold_up_no_other_request(om):
    server = _server(om)
    engine = server.engines["tiny"]
    params = {**GREEDY, "max_new_tokens": 4}

    async def scenario():
        # asyncio's own pool smaller than the turns, whatever the machine's cores (min(32, cores + 4) threads)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
        turns = []
        for i in range(engine.config.max_batch_size):
            _long_history(server, f"c{i}")
            turns.append(asyncio.ensure_future(server.admit(None, None, "/x", params, 1, messages=[],
                                                            conversation=(f"c{i}", None, "next"))))
        deadline = time.monotonic() + 60
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < len(turns):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)  # every turn is waiting for its summary
        plain, = await server.admit(None, None, "/x", params, 1, prompt="hi")
        assert not any(turn.done() for turn in turns)  # admitted while every summary is still being written
        server.close()  # a summary the closing engine ended is no summary: the turn is refused, nothing kept
        ended = await asyncio.gather(*turns, return_exceptions=True)
        assert [(type(e), getattr(e, "status", None)) for e in ended] == [(Refusal, 503)] * len(turns)
        assert all(server.conversations["tiny"].get(f"c{i}").summary is None for i in range(len(turns)))

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_a_turn_whose_summary_outlasts_the_request_timeout_is_ended_with_504(om):
    server = _server(om, settings=ServerSettings(request_timeout_s=2.0))
    engine = server.engines["tiny"]
    # the summary's first step is held until well past the deadline, however fast the host
    gate, run = threading.Event(), engine.runner.run
    def held(batch):
        assert gate.wait(timeout=60)
        return run(batch)

    engine.runner.run = held
    try:
        history = _long_history(server, "slow")
        opening = threading.Timer(5.0, gate.set)
        opening.start()
        refusal = _refused(lambda: asyncio.run(server.admit(None, None, "/x", {**GREEDY, "max_new_tokens": 4}, 1,
                                                            messages=[], conversation=("slow", None, "next"))))
        opening.join()
        assert (refusal.status, refusal.kind) == (504, "timeout")
        kept = server.conversations["tiny"].get("slow")
        assert kept.turns == history and kept.summary is None and kept.compacted == 0  # nothing half-done kept
        assert server.conversations["tiny"].lock("slow").acquire(blocking=False)
        assert engine.stats.prompt_tokens > 3000  # the summary's request ran, and the engine ended it at the deadline
        _wait_until(lambda: not engine.scheduler.running and not engine.scheduler.waiting)
        assert _count(server, "rejected") == 1
    finally:
        gate.set()
        server.close()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="the system has no dual-stack sockets")
def test_listening_on_every_ipv6_address_takes_ipv4_too():
    from cann_llm.runtime.serving.lifecycle import listen

    with listen("::", 0) as listener:
        port = listener.getsockname()[1]
        for address in ("127.0.0.1", "::1"):
            try:
                connection = socket.create_connection((address, port), timeout=10)
            except OSError:
                assert address == "::1"  # IPv6 switched off in the host's settings: IPv4 is the point here
                continue
            with connection:
                listener.settimeout(10)
                listener.accept()[0].close()
