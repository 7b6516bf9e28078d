"""Hostile requests against a real `cann-run serve` of tiny Llama on 127.0.0.1 (hypothesis, derandomized):
no 5xx other than 503/504, every error in OpenAI's shape (in a stream too), and the server alive and idle
after them all."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fuzz_requests import request
from generation_utils import compile_tiny_chat_model
from hypothesis import HealthCheck, Phase, given, settings

HTTP_CASES = 150
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    om = compile_tiny_chat_model(tmp_path_factory, TEMPLATE)
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    argv = [sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--model", f"tiny={om}", "--port", str(port),
            "--kv_cache_pages", "32", "--max_context_len", "256"]
    with open(log, "w") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    else:
        process.kill()
        raise TimeoutError(f"the server did not become healthy: {log.read_text()[-2000:]}")
    yield url, process, log
    process.terminate()
    process.wait(timeout=60)


def _error_shape(payload) -> str | None:
    """Why `payload` is not OpenAI's error shape, or None."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"not OpenAI's error shape: {str(payload)[:200]}"
    return None


def _server_fault(status) -> bool:
    return isinstance(status, int) and status >= 500 and status not in (503, 504)


def _check(client: httpx.Client, url: str, path: str, body: bytes, stream: bool) -> str | None:
    """What is wrong with the server's answer to one request, or None."""
    headers = {"content-type": "application/json"}
    if not stream:
        response = client.post(url + path, content=body, headers=headers)
        if _server_fault(response.status_code):
            return f"{response.status_code}: {response.text[:200]}"
        try:
            payload = response.json()
        except ValueError:
            return f"{response.status_code} with a body that is not JSON: {response.text[:200]!r}"
        return _error_shape(payload) if response.status_code >= 400 else None
    with client.stream("POST", url + path, content=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            if _server_fault(response.status_code):
                return f"{response.status_code}: {response.text[:200]}"
            return _error_shape(response.json())
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"a stream that does not end in [DONE]: {events[-3:]}"
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload and (_error_shape(payload) or _server_fault(payload["error"].get("code"))):
            return f"a stream's error event: {event[:200]}"
    return None


class _Bystander(threading.Thread):
    """A well-formed client asking for 32 tokens again and again while the fuzz runs: every answer must be
    whole, whatever the requests beside it in the batch carried."""

    BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.answers, self.wrong = url, threading.Event(), 0, []

    def run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                response = client.post(f"{self.url}/v1/completions", json=self.BODY)
                tokens = response.json().get("usage", {}).get("completion_tokens") if response.status_code == 200 else None
                if tokens != 32:
                    self.wrong.append(f"{response.status_code}: {response.text[:200]}")
                self.answers += 1


def test_hostile_requests_get_openai_errors_and_never_a_server_fault(server):
    url, process, log = server
    failures = []
    bystander = _Bystander(url)
    bystander.start()

    @settings(derandomize=True, database=None, deadline=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck), max_examples=HTTP_CASES)
    @given(request())
    def one(drawn):
        path, body, stream = drawn
        with httpx.Client(timeout=120) as client:
            try:
                wrong = _check(client, url, path, body, stream)
            except httpx.TransportError as error:
                wrong = f"the connection failed: {type(error).__name__}: {error}"
        if wrong:
            failures.append(f"POST {path} {body[:160]!r}: {wrong}")

    one()
    bystander.stop.set()
    bystander.join(timeout=120)
    assert process.poll() is None, log.read_text()[-3000:]
    assert bystander.answers > 0 and not bystander.wrong, bystander.wrong[:5]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert not failures, f"{len(failures)} of {HTTP_CASES} requests answered wrongly:\n" + "\n".join(failures[:20])
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
