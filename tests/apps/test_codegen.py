"""The code-generation app: the extractor on ten shapes of model output, the syntax check and its one
retry on a tiny model, and the service over HTTP on 127.0.0.1."""

from __future__ import annotations


import httpx
import pytest
from app_process import app_process
from generation_utils import compile_tiny_chat_model

from apps.codegen import CodeGenerator, extract_code
from apps.codegen.service import syntax_error
from runtime.engine.engine import LLMEngine

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
])
def test_code_is_extracted_from_ten_shapes_of_answer(answer, language, code):
    assert extract_code(answer, language) == code


def test_python_is_checked_and_other_languages_are_not():
    assert syntax_error(SQUARE, "python") is None
    assert syntax_error("def f(:\n", "python").startswith("line 1:")
    assert syntax_error("def f(:\n", "javascript") is None


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE, "codegen")


def test_an_answer_that_does_not_parse_gets_one_more_try(om):
    """The tiny model writes random bytes: never Python, so the retry always runs, and stops at one."""
    with LLMEngine(om, max_context_len=512, kv_cache_pages=16) as engine:
        result = CodeGenerator(engine, max_new_tokens=24).generate_code("add two numbers", "python")
        assert result.attempts == 2 and result.valid is False and result.error.startswith("line ")
        assert result.code == extract_code(result.answer, "python")
        other = CodeGenerator(engine, max_new_tokens=24).optimize_code("let a = 1;", "javascript")
        assert other.attempts == 1 and other.valid is None


def test_the_service_answers_over_http(om):
    with app_process("apps.codegen", "serve", "--model", str(om), "--max_new_tokens", "16") as url:
        made = httpx.post(f"{url}/generate", json={"description": "add two numbers"}, timeout=120).json()
        assert set(made) == {"code", "answer", "valid", "error", "attempts"} and made["attempts"] in (1, 2)
        optimized = httpx.post(f"{url}/optimize", json={"code": SQUARE, "language": "python"}, timeout=120).json()
        assert optimized["code"] == extract_code(optimized["answer"], "python")
        assert httpx.post(f"{url}/generate", json={"description": ""}, timeout=30).status_code == 422
