"""The code-generation app: the extractor on the shapes of model output, the syntax check and its one retry
on a tiny model, the service over HTTP on 127.0.0.1 with its refusals (too large, blank, too long for the
model), and the command's refusals of a user's mistakes: one coded message, never a traceback."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from app_process import app_process, assert_refused, run_app
from generation_utils import compile_tiny_chat_model

from cann_llm.apps.codegen import CodeGenerator, extract_code
from cann_llm.apps.codegen.service import GENERATE, syntax_error
from cann_llm.models.tiny import tiny_onnx
from cann_llm.runtime.engine.engine import LLMEngine

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
SQUARE = "def square(x):\n    return x * x\n"


@pytest.mark.parametrize("answer,language,code", [
    (f"```python\n{SQUARE}```", "python", SQUARE),                                          # fenced
    (f"Here it is:\n\n```py\n{SQUARE}```\n\nIt squares x.", "python", SQUARE),              # prose around
    (f"```\n{SQUARE}```", "python", SQUARE),                                                # no language
    (f"~~~python\n{SQUARE}~~~", "python", SQUARE),                                          # tildes
    (f"```python\n{SQUARE}", "python", SQUARE),                                             # cut off, never closed
    (f"```js\nconst a = 1;\n```\n```python\n{SQUARE}```", "python", SQUARE),                # the asked language
    ("```python\nimport math\n```\nthen\n```python\nx = math.pi\n```", "python", "import math\n\nx = math.pi\n"),
    ("Sure, the function:\n\n    def square(x):\n        return x * x\n\nDone.", "python", SQUARE),  # indented
    (SQUARE, "python", SQUARE),                                                             # bare code
    (f"Here is the code:\n{SQUARE}This returns the square.", "python", SQUARE),             # unfenced, prose lines
    ("1. Do this:\n   ```python\n   x = 1\n   y = 2\n   ```", "python", "x = 1\ny = 2\n"),   # fence in a list item
    ("```python\r\nx = 1\r\n```\r\n", "python", "x = 1\n"),                                 # Windows line ends
    # an indented line continues the block, whatever it starts with
    ("Here is the function:\ndef add_item(items, x):\n    items.append(x)\nIt appends x.", "python",
     "def add_item(items, x):\n    items.append(x)\n"),
    ("def check(x):\n    if x < 0:\n        raise ValueError(x)\n    yield x\nIt checks x.", "python",
     "def check(x):\n    if x < 0:\n        raise ValueError(x)\n    yield x\n"),
    ("import sys\nraise SystemExit(1)\nThis exits.", "python", "import sys\nraise SystemExit(1)\n"),
])
def test_code_is_extracted_from_every_shape_of_answer(answer, language, code):
    assert extract_code(answer, language) == code


def test_python_is_checked_and_other_languages_are_not():
    assert syntax_error(SQUARE, "python") is None
    assert syntax_error("def f(:\n", "python").startswith("line 1:")
    assert syntax_error("def f(:\n", "javascript") is None


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE, "codegen")


@pytest.fixture(scope="module")
def om_without_template(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, "", "codegen-no-template")


def test_an_answer_that_does_not_parse_gets_one_more_try(om):
    """The tiny model writes random bytes: never Python, so the retry always runs, and stops at one."""
    with LLMEngine(om, max_context_len=512, kv_cache_pages=16) as engine:
        result = CodeGenerator(engine, max_new_tokens=24).generate_code("add two numbers", "python")
        assert result.attempts == 2 and result.valid is False and result.error.startswith("line ")
        assert result.code == extract_code(result.answer, "python")
        other = CodeGenerator(engine, max_new_tokens=24).optimize_code("let a = 1;", "javascript")
        assert other.attempts == 1 and other.valid is None


def test_a_retry_the_context_cannot_hold_leaves_the_first_answer(om):
    """The context holds the request and its answer exactly: the retry, longer, does not fit."""
    request = [{"role": "user", "content": GENERATE.format(language="python", description="add two numbers")}]
    with LLMEngine(om, max_context_len=512, kv_cache_pages=16) as engine:
        prompt_tokens = len(engine.chat_prompt(request))
    with LLMEngine(om, max_context_len=prompt_tokens + 8, kv_cache_pages=16) as engine:
        result = CodeGenerator(engine, max_new_tokens=8).generate_code("add two numbers", "python")
        assert result.attempts == 1 and result.valid is False


def test_the_service_answers_over_http(om):
    with app_process("cann_llm.apps.codegen", "serve", "--model", str(om), "--max_new_tokens", "16") as url:
        made = httpx.post(f"{url}/generate", json={"description": "add two numbers"}, timeout=120).json()
        assert set(made) == {"code", "answer", "valid", "error", "attempts"} and made["attempts"] in (1, 2)
        optimized = httpx.post(f"{url}/optimize", json={"code": SQUARE, "language": "python"}, timeout=120).json()
        assert optimized["code"] == extract_code(optimized["answer"], "python")
        assert httpx.post(f"{url}/generate", json={"description": ""}, timeout=30).status_code == 422


def test_the_service_refuses_what_it_cannot_answer_with_the_reason(om):
    """The tiny model's byte tokenizer makes each emoji four tokens: 3,990 of them are past its 4,096."""
    with app_process("cann_llm.apps.codegen", "serve", "--model", str(om), "--max_new_tokens", "16") as url:
        for path, body in [("generate", {"description": "🚚" * 3990}), ("optimize", {"code": "x = 1\n" * 5000})]:
            refused = httpx.post(f"{url}/{path}", json=body, timeout=120)
            assert refused.status_code == 422 and "does not fit the context" in refused.json()["detail"]
        blank = httpx.post(f"{url}/generate", json={"description": " \n", "language": "python"}, timeout=30)
        assert blank.status_code == 422 and blank.json()["detail"][0]["loc"] == ["body", "description"]
        surrogate = httpx.post(f"{url}/generate", content=json.dumps({"description": "add \ud800"}),
                               headers={"content-type": "application/json"}, timeout=30)
        assert surrogate.status_code == 422
        too_long = httpx.post(f"{url}/generate", json={"description": "x" * 500_000}, timeout=30)
        assert too_long.status_code == 422 and len(too_long.content) < 1000  # the input is not echoed back
        too_large = httpx.post(f"{url}/optimize", json={"code": "x" * 2_000_000}, timeout=30)
        assert too_large.status_code == 413 and "--max-body-bytes" in too_large.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def not_text(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "binary.bin").write_bytes(b"\x00\xc9\xff\xfe code?")
    (folder / "empty.py").write_text("\n  \n")
    return folder


@pytest.mark.parametrize("argv,said", [
    (["generate", "--model", "/nope.om", "add"], ["E13001", "/nope.om"]),
    (["generate", "--model", "{onnx}", "add"], ["E13015", "ONNX model"]),
    (["generate", "--model", "{no_template}", "add"], ["E10055", "compiled without one"]),
    (["serve", "--model", "{no_template}"], ["E10055", "compiled without one"]),
    (["optimize", "--model", "{om}", "{inputs}/binary.bin"], ["E13001", "not UTF-8"]),
    (["optimize", "--model", "{om}", "{inputs}/empty.py"], ["E10001", "SOURCE", "it is empty"]),
    (["generate", "--model", "{om}", ""], ["E10001", "DESCRIPTION", "it is empty"]),
    (["generate", "--model", "{om}", "add \udcff"], ["E10001", "DESCRIPTION", "not valid UTF-8"]),  # byte 0xff
    (["generate", "--model", "{om}", "🚚" * 1100], ["E10001", "does not fit the context"]),
    (["serve", "--model", "{om}", "--port", "99999"], ["99999 is not in the range 0<=x<=65535"]),
    (["serve", "--model", "{om}", "--max_new_tokens", "0"], ["0 is not in the range x>=1"]),
    (["serve", "--model", "{om}", "--max_new_tokens", "5000"], ["E10001", "--max_new_tokens", "context holds 4096"]),
])
def test_the_command_refuses_a_users_mistake_with_one_coded_message(argv, said, om, om_without_template, not_text):
    paths = {"om": om, "no_template": om_without_template, "inputs": not_text,
             "onnx": tiny_onnx("llama", dynamo=False, with_past=True)}
    done = run_app("cann_llm.apps.codegen", *[arg.format(**paths) for arg in argv])
    assert_refused(done, *said)
    assert "codegen serving on" not in done.stderr and done.stdout == ""


def test_a_port_in_use_is_refused_before_the_model_loads(om):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        done = run_app("cann_llm.apps.codegen", "serve", "--model", str(om), "--port", str(taken.getsockname()[1]))
    assert_refused(done, "E10001", "--host/--port")
    assert "loading" not in done.stderr
