"""`cann-run serve` over real HTTP on 127.0.0.1: the official openai client, the seed's /generate,
streaming, metrics, and every refusal (each server runs in its own process, as users start it)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from generation_utils import compile_tiny_chat_model
from served import Server, StderrLines, free_port

from cann_llm.runtime.engine.engine import LLMEngine

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(om):
    """Serving with prompt-lookup drafts, against an engine without them: the answers must not differ."""
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "32", "--max_context_len", "4096",
                    "--num_speculative_tokens", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(om):
    with LLMEngine(om, kv_cache_pages=32, max_context_len=256) as engine:
        yield engine


def test_openai_client_completes_chats_and_streams_like_the_engine(server, engine):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    expected = engine.generate("hello", max_new_tokens=16, temperature=0)
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="hello", max_tokens=16,
                                                                     temperature=0, stream=True)]
    assert "".join(pieces) == expected and len(pieces) > 2

    messages = [{"role": "user", "content": "Say something"}]
    expected_chat = engine.chat(messages, max_new_tokens=12, temperature=0)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected_chat and reply.choices[0].message.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)]
    assert "".join(deltas) == expected_chat


def test_the_seeds_generate_endpoint(server, engine):
    response = httpx.post(f"{server.url}/generate", json={"prompt": "abc", "max_length": 10, "temperature": 0}, timeout=60)
    body = response.json()
    assert response.status_code == 200
    assert body["text"] == engine.generate("abc", max_new_tokens=10, temperature=0)
    assert body["inference_time_ms"] > 0 and body["completion_tokens"] == 10 and body["prompt_tokens"] == 3


@pytest.mark.parametrize("path,payload,status", [
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 4}, 400),    # longer than the context
    ("/v1/completions", {"model": "tiny", "prompt": [5, 1_000_000], "max_tokens": 4}, 400),  # outside the vocabulary
    ("/v1/completions", {"model": "tiny", "prompt": [-1], "max_tokens": 4}, 400),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10 ** 6}, 400),       # past the context
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400),
    ("/v1/completions", '{"model": "tiny", "prompt": "a \\ud800 lone surrogate"}', 400),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["s"] * 17}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": "s" * 257}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "repetition_penalty": 1e-308}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
    ("/generate", {"max_length": 3}, 400),
    ("/generate", "{not json", 400),
    ("/generate", b"\xff\xfe\x00", 400),                                                  # not text at all
    ("/v1/completions", '{"prompt": ' + "[" * 100_000, 400),                               # past the parser's depth
])
def test_bad_requests_are_refused_cleanly(server, path, payload, status):
    kwargs = {"content": payload, "headers": {"content-type": "application/json"}} \
        if isinstance(payload, (str, bytes)) else {"json": payload}
    response = httpx.post(f"{server.url}{path}", **kwargs, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == ("invalid_request_error" if status == 400 else error["type"])


def test_refusals_name_the_field_at_fault_or_none(server):
    """OpenAI's `param`: the field a refusal is about; none for a body that is not JSON at all (its location
    is a character offset, not a field), `max_tokens` for a completion the context cannot hold."""
    def error_of(response):
        assert response.status_code == 400
        return response.json()["error"]

    headers = {"content-type": "application/json"}
    assert error_of(httpx.post(f"{server.url}/v1/chat/completions", content='{"model": "tiny", "messages": [',
                               headers=headers, timeout=60))["param"] is None
    for field in ("max_tokens", "max_completion_tokens"):
        refused = error_of(httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], field: 10 ** 6}))
        assert refused["param"] == field and "maximum context length" in refused["message"]
    # the engine's own checks name the field they refuse
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra, param in (({"temperature": 0.0005}, "temperature"), ({"min_tokens": 9}, "min_tokens"),
                         ({"stop_token_ids": [999999]}, "stop_token_ids"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                          "response_format")):
        assert error_of(httpx.post(f"{server.url}/v1/chat/completions", json={**chat, **extra}, timeout=60))["param"] == param


def test_a_model_is_retrieved_by_its_name(server):
    card = httpx.get(f"{server.url}/v1/models/tiny", timeout=60)
    assert card.status_code == 200 and card.json() == httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]
    absent = httpx.get(f"{server.url}/v1/models/nope", timeout=60)
    assert absent.status_code == 404 and absent.json()["error"]["param"] == "model"


def test_a_body_over_the_limit_is_413_whether_or_not_its_length_is_declared(server):
    body = json.dumps({"model": "tiny", "prompt": "x" * (4 * 1024 * 1024)}).encode()
    declared = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    chunked = httpx.post(f"{server.url}/v1/completions", headers={"content-type": "application/json"},
                         content=(body[i:i + 65536] for i in range(0, len(body), 65536)), timeout=60)
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.json()["error"]["message"] == "the request body is larger than 4194304 bytes (--max-body-bytes)"
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200


def test_a_hostile_request_does_not_hurt_one_running_beside_it(server, engine):
    """Out-of-vocabulary ids, NaN and a lone surrogate sent while a good request streams: each is a 400,
    and the good one's text is exactly what it gets alone."""
    expected = engine.generate("good", max_new_tokens=60, temperature=0, ignore_eos=True)
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json={"model": "tiny", "prompt": "good", "max_tokens": 60, "temperature": 0,
                                         "ignore_eos": True, "stream": True}, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        hostile = [httpx.post(url, json={"model": "tiny", "prompt": [3, 10 ** 9], "max_tokens": 8}, timeout=60),
                   httpx.post(url, json={"model": "tiny", "prompt": [-5, 3], "max_tokens": 8}, timeout=60),
                   httpx.post(url, content='{"model": "tiny", "prompt": "x", "temperature": NaN}',
                              headers={"content-type": "application/json"}, timeout=60),
                   httpx.post(url, content='{"model": "tiny", "prompt": "\\ud800"}',
                              headers={"content-type": "application/json"}, timeout=60)]
        events = [first] + [line for line in lines if line]
    assert [r.status_code for r in hostile] == [400] * 4
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == expected and chunks[-1]["finish_reason"] == "length"


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    cancelled = server.metric("cann_llm:requests_total", model_name="tiny", outcome="cancelled")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3000,
                                                                     "temperature": 0, "stream": True},
                      timeout=60) as response:
        next(response.iter_lines())
    deadline = time.time() + 120
    while server.metric("cann_llm:requests_total", model_name="tiny", outcome="cancelled") == cancelled:
        assert time.time() < deadline
        time.sleep(0.05)
    assert server.metric("cann_llm:kv_cache_usage_perc", model_name="tiny") == 0


def test_an_idle_connection_is_kept_past_the_clients_keep_alive_expiry(server):
    """httpx (and so the openai SDK) reuses an idle connection for 5 s: a server closing it at 5 s races the
    reuse and fails the request; ours keeps it longer, so a connection idle 6 s still serves."""
    with httpx.Client(base_url=server.url, limits=httpx.Limits(keepalive_expiry=60), timeout=60) as client:
        first = client.get("/health")
        time.sleep(6)
        second = client.get("/health")
    assert first.status_code == second.status_code == 200
    assert first.extensions["network_stream"] is second.extensions["network_stream"]  # the same connection


def test_metrics_add_up(server, engine):
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    assert "cann_llm:time_to_first_token_seconds_bucket" in text and "cann_llm:num_requests_running" in text
    outcomes = {o: server.metric("cann_llm:requests_total", model_name="tiny", outcome=o)
                for o in ("completed", "rejected", "cancelled", "failed")}
    # what the tests above sent: 6 answered (a completion and a chat, each also streamed, /generate, and the
    # stream beside hostile ones), 14 refused by the engine's checks or for the context (an over-long prompt,
    # 4 with ids outside the vocabulary, an overflowing penalty, 3 asking for more tokens than the context
    # holds, 5 with a setting out of range), 1 stream left mid-way; unknown models and bodies that fail
    # validation never reach an engine
    assert outcomes == {"completed": 6, "rejected": 14, "cancelled": 1, "failed": 0}
    assert server.metric("cann_llm:request_success_total", model_name="tiny", finished_reason="length") >= 1
    drafted = server.metric("cann_llm:spec_decode_num_draft_tokens_total", model_name="tiny")
    assert drafted > 0 and 0 <= server.metric("cann_llm:spec_decode_num_accepted_tokens_total", model_name="tiny") <= drafted
    # vLLM's types: counters end in _total, none has a _created series, engine counters are counters
    assert "_created" not in text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert {types[f"cann_llm:{name}_total"] for name in ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions",
                                                          "spec_decode_num_draft_tokens", "prompt_tokens")} == {"counter"}
    ran = sum(outcomes[o] for o in ("completed", "cancelled", "failed"))
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "e2e_request_latency_seconds"):
        assert types[f"cann_llm:{name}"] == "histogram"
        assert server.metric(f"cann_llm:{name}_count", model_name="tiny") == ran, name
    assert server.metric("cann_llm:request_prompt_tokens_sum", model_name="tiny") == server.metric(
        "cann_llm:prompt_tokens_total", model_name="tiny")
    # every token a step ran, prompts' included: at least the tokens generated, and a step runs at least one
    assert types["cann_llm:iteration_tokens_total"] == "histogram"
    steps = server.metric("cann_llm:iteration_tokens_total_count", model_name="tiny")
    assert server.metric("cann_llm:iteration_tokens_total_bucket", model_name="tiny", le="+Inf") == steps
    assert server.metric("cann_llm:iteration_tokens_total_sum", model_name="tiny") >= max(steps, server.metric(
        "cann_llm:generation_tokens_total", model_name="tiny"))
    assert 0 < server.metric("cann_llm:request_time_per_output_token_seconds_count", model_name="tiny") <= ran
    # the pool's written pages, which stay resident: whole pages, some written, at most the 32 of the pool
    resident = server.metric("cann_llm:kv_cache_resident_bytes", model_name="tiny")
    assert resident % engine.kv_bytes_per_page == 0 and 0 < resident <= 32 * engine.kv_bytes_per_page


# (after test_metrics_add_up, which counts the requests of the tests before it)
def test_a_conversation_id_has_the_server_keep_the_history(server, engine):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    turn = {"model": "tiny", "max_tokens": 6, "temperature": 0, "extra_body": {"conversation_id": "http-1"}}
    first = client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], **turn)
    second = client.chat.completions.create(messages=[{"role": "user", "content": "again"}], **turn)
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "again"}]
    # the second turn is answered as if the client had sent the whole history itself
    assert second.choices[0].message.content == engine.chat(history, max_new_tokens=6, temperature=0)
    assert second.usage.prompt_tokens == len(engine.chat_prompt(history))
    for bad in ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}]},
                {"messages": [{"role": "user", "content": "a"}], "n": 2}):
        with pytest.raises(BadRequestError):
            client.chat.completions.create(**{**turn, **bad})


def test_a_metrics_prefix_of_vllm_gives_vllms_names(om):
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "32", "--metrics-prefix", "vllm:")
    try:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
                   timeout=60)
        text = httpx.get(f"{server.url}/metrics", timeout=60).text
        assert server.metric("vllm:generation_tokens_total", model_name="tiny") == 3
        assert server.metric("vllm:request_decode_time_seconds_count", model_name="tiny") == 1
        assert "vllm:num_requests_waiting" in text and "cann_llm:" not in text
    finally:
        server.stop()


def test_metrics_report_the_server_process_resident_memory(server):
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    resident = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024
    reported = server.metric("process_resident_memory_bytes")
    assert 0.8 * resident <= reported <= 1.25 * resident


def test_keys_quotas_timeouts_capacity_filter_and_audit(om, tmp_path):
    blocklist, audit = tmp_path / "block.txt", tmp_path / "audit.jsonl"
    blocklist.write_text("forbidden\n")
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "32", "--max_context_len", "4096", "--api-key", "k1",
                    "--api-key", "k2", "--api-key", "k3", "--quota-tokens", "4000", "--audit-log", str(audit),
                    "--blocklist", str(blocklist), "--request-timeout", "0.1", "--max-pending", "2",
                    "--max_num_batched_tokens", "1")
    try:
        url = f"{server.url}/v1/completions"
        # a token a step, EOS held off (a cached prompt and an early EOS could otherwise finish within 0.1 s)
        slow = {"prompt": "x" * 200, "max_tokens": 3500, "temperature": 0, "ignore_eos": True}
        got = [httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code]
        k1, k2, k3 = ({"Authorization": f"Bearer {key}"} for key in ("k1", "k2", "k3"))
        got.append(httpx.post(url, json={"prompt": "a Forbidden word", "max_tokens": 2}, headers=k1, timeout=60).status_code)
        assert got == [401, 400]
        # more choices than --max-pending could ever admit: a 400 naming n, not a 429 to retry
        too_many = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "n": 3}, headers=k1, timeout=60)
        assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "n")
        got.append(400)
        with httpx.Client(timeout=30) as client:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                statuses = list(pool.map(lambda _: client.post(url, json=slow, headers=k2), range(6)))
        codes = sorted(r.status_code for r in statuses)
        assert 429 in codes and 504 in codes and set(codes) <= {429, 504}
        # over capacity, retry shortly; past k2's quota (one such request reserves 3,700 tokens of its 4,000), never
        kinds = {(r.json()["error"]["type"], r.headers.get("retry-after")) for r in statuses if r.status_code == 429}
        assert kinds <= {("rate_limit_exceeded", "1"), ("insufficient_quota", None)}
        assert httpx.post(url, json=slow, headers=k1, timeout=30).status_code == 504
        got += codes + [504]
        # a stream is held to the same deadline: it ends with OpenAI's error event, then [DONE]
        with httpx.stream("POST", url, json={**slow, "max_tokens": 2000, "stream": True}, headers=k3,
                          timeout=30) as response:
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 504
        got.append(504)
        assert server.metric("cann_llm:kv_cache_usage_perc", model_name="tiny") == 0
        # a slow request reserves its prompt and all it may generate (3,700 tokens) and is refunded what it did
        # not use: k1 has at most 3,800 left, not enough for a request that may use 3,902
        spent = httpx.post(url, json={"prompt": "hi", "max_tokens": 3900}, headers=k1, timeout=60)
        assert spent.status_code == 429 and "quota" in spent.json()["error"]["message"]
        got.append(429)
        # the same refusals as the openai SDK's own exception types, in OpenAI's shape
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as limited:
            sdk.completions.create(model="tiny", prompt="hi", max_tokens=3900)
        # a quota never refills: the client is told not to retry (the SDK would, by itself, on a 429)
        headers = limited.value.response.headers
        assert limited.value.body["type"] == "insufficient_quota" and "retry-after" not in headers
        assert headers["x-should-retry"] == "false"
        got.append(429)
        # on a key of its own: what k1 has left depends on how soon its timed-out request was stopped
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k3", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as late:
            sdk.completions.create(model="tiny", prompt="x" * 200, max_tokens=2000, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert late.value.status_code == 504 and late.value.body["type"] == "timeout"
        got.append(504)
        # a short answer fits the 0.1 s deadline unless the host stalls the server that long: tried until it
        # does, and the audit read against what each try got
        tries: list[int] = []
        while len(tries) < 10 and 200 not in tries:
            tries.append(httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=k1, timeout=60).status_code)
        assert tries[-1] == 200 and set(tries) <= {200, 504}
        # every request, refused or answered, with the status its client got
        records = [json.loads(line) for line in audit.read_text().splitlines()]
        assert sorted(r["status"] for r in records) == sorted(got + tries)
        assert [r["status"] for r in records[-len(tries):]] == tries
        assert records[0]["key_id"] == "anonymous" and all(r["key_id"].startswith("key-") for r in records[1:])
        assert "k1" not in audit.read_text() and all(r["tokens_in"] == 200 for r in records if r["status"] == 504)
    finally:
        server.stop()


def test_twelve_concurrent_requests_cannot_overdraw_a_60_token_quota(om, tmp_path):
    """Each may use 10 tokens (a 2-token prompt, 8 to generate): 6 fit the quota, whatever the interleaving."""
    audit = tmp_path / "audit.jsonl"
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "32", "--api-key", "k", "--quota-tokens", "60",
                    "--audit-log", str(audit))
    try:
        at_once = threading.Barrier(12)

        def ask(_):
            at_once.wait()
            return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer k"}, timeout=120,
                              json={"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True})

        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        assert sorted(a.status_code for a in answers) == [200] * 6 + [429] * 6
        assert all(a.json()["usage"]["total_tokens"] == 10 for a in answers if a.status_code == 200)
        assert {a.json()["error"]["type"] for a in answers if a.status_code == 429} == {"insufficient_quota"}
        records = [json.loads(line) for line in audit.read_text().splitlines()]
        assert sum(r["tokens_in"] + r["tokens_out"] for r in records) == 60
    finally:
        server.stop()


def test_two_names_for_one_file_share_one_engine_and_health_waits_for_loading(om, engine):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", str(port), "--model", f"a={om}",
                                "--model", f"b={om}", "--kv_cache_pages", "32"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        codes, scrapes = [], []
        deadline = time.time() + 120
        while not codes or codes[-1] != 200:
            assert time.time() < deadline and process.poll() is None
            try:
                codes.append(httpx.get(f"{url}/health", timeout=2).status_code)
                if codes[-1] == 503:  # loading: the process's own metrics are scraped meanwhile
                    scrape = httpx.get(f"{url}/metrics", timeout=2)
                    scrapes.append((scrape.status_code, "process_resident_memory_bytes" in scrape.text))
            except httpx.TransportError:
                time.sleep(0.05)
        assert set(codes) <= {503, 200} and set(scrapes) <= {(200, True)}
        assert httpx.get(f"{url}/health", timeout=60).json()["models"] == ["a", "b"]
        expected = engine.generate("hey", max_new_tokens=8, temperature=0)
        for name in ("a", "b"):
            body = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "hey", "max_tokens": 8,
                                                             "temperature": 0}, timeout=60).json()
            assert body["choices"][0]["text"] == expected and body["model"] == name
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert process.returncode == 0 or process.returncode == -15


def test_sigterm_answers_every_request_in_flight_and_accounts_for_it(om, tmp_path):
    """SIGTERM with requests in flight that need thousands of steps, one running at a time, and no grace:
    each gets a whole answer or OpenAI's 503 error (a stream, as its last event), is audited with the
    status it got, and nothing is cut or logged as a traceback."""
    audit = tmp_path / "audit.jsonl"
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "300", "--max_context_len", "4096",
                    "--max_batch_size", "1", "--shutdown-grace", "0", "--audit-log", str(audit))
    url = f"{server.url}/v1/completions"
    endless = {"model": "tiny", "prompt": "x" * 1000, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    answers, events = [], []

    def post() -> None:
        answers.append(httpx.post(url, json=endless, timeout=120))

    def stream() -> None:
        with httpx.stream("POST", url, json={**endless, "stream": True}, timeout=120) as response:
            events.extend(line for line in response.iter_lines() if line)

    clients = [threading.Thread(target=post) for _ in range(2)] + [threading.Thread(target=stream)]
    for client in clients:
        client.start()
    deadline = time.time() + 120
    while server.metric("cann_llm:num_requests_running", model_name="tiny") + \
            server.metric("cann_llm:num_requests_waiting", model_name="tiny") < 3:
        assert time.time() < deadline, "the requests never reached the engine"
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal it caught once it is done: the exit status says SIGTERM
    assert server.process.wait(timeout=120) in (0, -signal.SIGTERM)
    for client in clients:
        client.join(timeout=120)
        assert not client.is_alive()
    statuses = [answer.status_code for answer in answers]
    for answer in answers:
        if answer.status_code == 200:
            assert answer.json()["usage"]["completion_tokens"] == 3000
        else:
            assert answer.json() == {"error": {"message": "the server shut down before the request finished",
                                               "type": "unavailable", "param": None, "code": 503}}
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    statuses.append(last["error"]["code"] if "error" in last else 200)
    # run one at a time, the last of the three still had 12,000 steps to go when the signal could be sent
    assert 503 in statuses and set(statuses) <= {200, 503}
    assert sorted(json.loads(line)["status"] for line in audit.read_text().splitlines()) == sorted(statuses)
    log = server.stderr.all()
    assert "Traceback" not in log and "Cancel" not in log, log


def test_a_second_signal_ends_what_is_running_at_once_with_503(om):
    """With a grace period far longer than the test, a second SIGTERM ends the request in flight now, with
    OpenAI's 503, rather than handing over to uvicorn (which cut it with a plain-text 500 after 10 s)."""
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "300", "--max_context_len", "32768",
                    "--shutdown-grace", "600")
    url = f"{server.url}/v1/completions"
    endless = {"model": "tiny", "prompt": "x" * 1000, "max_tokens": 30000, "temperature": 0, "ignore_eos": True}
    answers = []
    client = threading.Thread(target=lambda: answers.append(httpx.post(url, json=endless, timeout=300)))
    client.start()
    deadline = time.time() + 120
    while server.metric("cann_llm:num_requests_running", model_name="tiny") < 1:
        assert time.time() < deadline, "the request never reached the engine"
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    while httpx.get(f"{server.url}/health", timeout=60).json()["status"] != "shutting down":
        assert time.time() < deadline, "the drain never began"
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) in (0, -signal.SIGTERM)
    client.join(timeout=120)
    assert answers[0].status_code == 503 and "x-should-retry" not in answers[0].headers  # another replica may answer
    assert answers[0].json()["error"]["message"] == "the server shut down before the request finished"
    assert "Traceback" not in server.stderr.all()


def test_sigterm_during_32_streaming_and_plain_requests_with_a_core_busy(tmp_path):
    """One round of benchmarks/sigterm_soak.py (docs/reliability.md runs 20): 32 requests in flight, half
    streamed, another process spinning on a core; every client gets its whole answer or the 503 error, the
    log has no traceback and the audit log has every request with the status its client got."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sigterm_soak.py"
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(script), "--rounds", "1", "--json", str(report_path)],
                            capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    [round_] = report["results"]
    assert round_["problems"] == [] and sum(round_["statuses"].values()) == 32
    assert set(round_["statuses"]) <= {"200", "503"}


def test_serve_says_ready_only_once_its_engines_are_loaded_then_reports_stats(om, engine):
    process = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", "0", "--model", f"a={om}",
                                "--model", f"b={om}", "--kv_cache_pages", "32", "--stats-interval", "0.1"],
                               stderr=subprocess.PIPE, text=True, encoding="utf-8")
    stderr = StderrLines(process.stderr)
    try:
        ready = stderr.wait_for(lambda line: line.startswith("ready in "))
        before = stderr.lines[:stderr.lines.index(ready)]
        assert before[0] == f"loading a, b ({om}) …" and len(before) == 2  # one engine for the one file
        assert re.fullmatch(r"a, b: KV pool of 32 pages of \d+ tokens, \d+ MiB once all are written", before[1])
        address = re.fullmatch(r"ready in \d+\.\d s: (http://127\.0\.0\.1:\d+) \(models: a, b\)", ready)
        assert address, ready
        # sent the moment the line is out, no /health polling: the engine is loaded by then
        answer = httpx.post(f"{address[1]}/v1/completions", json={"model": "b", "prompt": "hey", "max_tokens": 8,
                                                                  "temperature": 0}, timeout=60)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == engine.generate("hey", max_new_tokens=8, temperature=0)
        stats = stderr.wait_for(lambda line: line.startswith("a, b: ") and " running, " in line
                                and " 0.0 tokens/s" not in line)
        assert re.fullmatch(r"a, b: \d+ running, \d+ waiting, \d+\.\d tokens/s, KV pages \d+/32", stats), stats
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_block_listed_output_is_cut_with_finish_reason_content_filter(om, engine, tmp_path):
    full = engine.generate("abc", max_new_tokens=30, temperature=0, ignore_eos=True)
    term = next(full[i:i + 3] for i in range(5, len(full) - 3) if full[i:i + 3].strip() and full[i:i + 3] not in "abc")
    (tmp_path / "block.txt").write_text(term + "\n")
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "32", "--blocklist", str(tmp_path / "block.txt"))
    try:
        body = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 30,
                                                                "temperature": 0}, timeout=60).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "content_filter" and choice["text"] == full[:full.index(term)]
        assert term not in choice["text"]
    finally:
        server.stop()


def test_a_port_in_use_is_a_coded_error_before_anything_loads(om):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", str(port), "--model",
                                 f"tiny={om}"], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert result.returncode == 1
    assert "E10001" in result.stderr and f"Value 127.0.0.1:{port} for parameter --host/--port" in result.stderr
    assert "loading" not in result.stderr and "Traceback" not in result.stderr


def test_a_model_without_a_tokenizer_serves_token_ids_and_refuses_echo(tiny_llama_path, tmp_path):
    import shutil

    from conftest import compile_to

    (tmp_path / "bare").mkdir()
    shutil.copyfile(tiny_llama_path, tmp_path / "bare" / "model.onnx")  # no tokenizer beside this copy
    bare = compile_to(tmp_path / "bare" / "model.onnx", tmp_path / "bare" / "m")
    served = Server("--model", f"bare={bare}", "--kv_cache_pages", "16", "--max_context_len", "256")
    try:
        body = {"model": "bare", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        # no text to give: the ids are the answer, unasked
        choice = answer.json()["choices"][0]
        assert answer.status_code == 200 and choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 4
        with LLMEngine(bare, kv_cache_pages=16, max_context_len=256) as engine:
            assert choice["token_ids"] == _greedy_ids(engine, [5, 6, 7], 4)
        refused = httpx.post(f"{served.url}/v1/completions", json={**body, "echo": True}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    finally:
        served.stop()


def test_one_name_for_two_artifacts_is_refused_and_one_artifact_under_two_names_is_served(om, tmp_path):
    """Names default to the file's stem, so two artifacts compiled as out/model.om collide."""
    other = tmp_path / "elsewhere" / om.name
    other.parent.mkdir()
    other.write_bytes(om.read_bytes())
    result = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", "0", "--model", str(om),
                             "--model", str(other)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "E10001" in result.stderr and "name each model: NAME=path.om" in result.stderr
    assert "loading" not in result.stderr and "Traceback" not in result.stderr
    server = Server("--model", f"a={om}", "--model", f"a={om}", "--model", f"b={om}", "--kv_cache_pages", "32")
    try:
        assert sorted(m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"]) == ["a", "b"]
    finally:
        server.stop()


def test_chat_with_a_model_compiled_without_a_chat_template_is_a_400_naming_the_fix(tmp_path_factory):
    no_template = compile_tiny_chat_model(tmp_path_factory, "", name="plain")
    server = Server("--model", f"plain={no_template}", "--kv_cache_pages", "32")
    try:
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        error = chat.json()["error"]
        assert (chat.status_code, error["type"], error["param"]) == (400, "invalid_request_error", "messages")
        assert "compiled without one" in error["message"] and "--chat_template_file" in error["message"]
        assert "parameter --model" not in error["message"]
        text = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "plain", "prompt": "hi", "max_tokens": 2})
        assert text.status_code == 200
    finally:
        server.stop()


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_as_vllm_does(server, engine):
    """vLLM's `return_token_ids`: `prompt_token_ids` on a completion's choice (chat: on the answer; a stream:
    in its first chunk) and each choice's `token_ids`, which a stream sends with the text they make."""
    ask = {"model": "tiny", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    expected = _greedy_ids(engine, "hello", 12)
    choice = httpx.post(f"{server.url}/v1/completions", json={**ask, "prompt": "hello"}, timeout=60).json()["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (engine.encode("hello"), expected)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**ask, "prompt": "hello", "stream": True},
                      timeout=60) as response:
        chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == engine.encode("hello")
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == expected
    # each chunk's ids are those of its text, not all held for the last one
    for k in range(1, len(chunks)):
        ids, text = [t for c in chunks[:k] for t in c["token_ids"]], "".join(c["text"] for c in chunks[:k])
        assert engine.tokenizer.decode(ids) == text
    assert sum(bool(c["token_ids"]) for c in chunks) > 2

    messages = [{"role": "user", "content": "Say something"}]
    prompt = engine.chat_prompt(messages)
    expected = _greedy_ids(engine, prompt, 12)
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={**ask, "messages": messages}, timeout=60).json()
    assert (chat["prompt_token_ids"], chat["choices"][0]["token_ids"]) == (prompt, expected)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**ask, "messages": messages, "stream": True},
                      timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt and not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == expected
    plain = httpx.post(f"{server.url}/v1/completions", json={**ask, "prompt": "hello", "return_token_ids": False},
                       timeout=60).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def _greedy_ids(engine: LLMEngine, prompt, new_tokens: int) -> list[int]:
    request = engine.submit(prompt, max_new_tokens=new_tokens, temperature=0)
    request.result()
    return request.output_ids


@pytest.mark.parametrize("argv, env, said", [
    (["--quota-tokens", "50"], {}, "E10055"),                                  # a quota counts per key
    (["--api-key", " "], {}, "an API key must not be empty"),
    (["--access-log"], {"CANN_LLM_API_KEYS": " k1 ,, k2 "}, None),             # trimmed, empty entries skipped
    (["--model", "x={tmp}"], {}, "the path is a directory"),
])
def test_serving_settings_an_operator_gets_wrong_are_refused_at_start(om, tmp_path, argv, env, said):
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    command = [sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", "0", "--model", f"tiny={om}", *argv]
    if said is None:  # starts: keys trimmed, empty entries dropped
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **env})
        try:
            ready = StderrLines(server.stderr).wait_for(lambda line: line.startswith("ready in "), timeout=600)
            url = re.search(r"http://127\.0\.0\.1:\d+", ready)[0]
            for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
                answer = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert answer.status_code == status, (key, answer.text)
            # the key is checked before the body is read: a caller without one learns nothing of what the body
            # would have been (it was a 400 naming the field at fault); liveness and the scrape need none
            for path, body in (("/v1/chat/completions", b"{not json"), ("/tokenize", b'{"prompt": 5}')):
                answer = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"},
                                    timeout=60)
                assert (answer.status_code, answer.json()["error"]["type"]) == (401, "authentication_error")
            assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401
            assert [httpx.get(f"{url}{path}", timeout=60).status_code for path in ("/health", "/metrics")] == [200, 200]
        finally:
            server.terminate()
            server.wait(timeout=60)
        stdout = server.stdout.read()  # a few lines: the pipe never filled
        # --access-log: a line for each request, with the status its client got
        logged = re.findall(r'"(GET|POST) (/\S*) HTTP/1\.1" (\d+)', stdout)
        assert [(path, int(status)) for _, path, status in logged] == [
            ("/v1/completions", 200), ("/v1/completions", 200), ("/v1/completions", 401),
            ("/v1/chat/completions", 401), ("/tokenize", 401), ("/v1/models", 401), ("/health", 200),
            ("/metrics", 200)]
        return
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 1 and said in result.stderr and "Traceback" not in result.stderr
    assert "loading" not in result.stderr
