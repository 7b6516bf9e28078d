"""Property-based requests from the server's own OpenAPI schema (schemathesis) against `cann-run serve` on
127.0.0.1: whatever the body, no 5xx, and every 4xx in OpenAI's error shape."""

from __future__ import annotations

import pytest
import schemathesis
from generation_utils import compile_tiny_chat_model
from hypothesis import HealthCheck, given, settings
from served import Server

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    om = compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)
    # a short context bounds what a generated max_tokens can ask for
    server = Server("--model", f"tiny={om}", "--kv_cache_pages", "64", "--max_context_len", "256",
                    "--max_batch_size", "16", "--request-timeout", "60")
    yield schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    server.stop()


def test_no_5xx_and_every_4xx_in_openais_shape(api):
    checked, seen = [], []
    for result in api.get_all_operations():
        operation = result.ok()

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        @given(case=operation.as_strategy())
        def answers_cleanly(case):
            response = case.call(timeout=120)
            seen.append((operation.path, response.status_code))
            assert response.status_code < 500, response.text[:500]
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code

        answers_cleanly()
        checked.append(f"{operation.method.upper()} {operation.path}")
    # the generated bodies reach the model too, not only the validation
    assert ("/v1/chat/completions", 200) in seen and ("/generate", 200) in seen
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize"} <= set(checked)
