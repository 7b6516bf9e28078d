"""The request bodies' validation (cann_llm/runtime/serving/wire.py) and the quota's reservations (guard.py), on
their own: no model, no server."""

from __future__ import annotations

import threading

import pydantic
import pytest

from cann_llm.runtime.serving.guard import Guard
from cann_llm.runtime.serving.wire import ChatBody, CompletionBody, GenerateBody, validation_error_body

pytestmark = pytest.mark.unit


def _refusal(body_type, body: dict) -> str:
    with pytest.raises(pydantic.ValidationError) as error:
        body_type(**body)
    # FastAPI puts "body" first in each location, as the route's handler sees it
    errors = [{**e, "loc": ("body", *e["loc"])} for e in error.value.errors()]
    return validation_error_body(errors)["error"]["message"]


@pytest.mark.parametrize("model,body,message", [
    (CompletionBody, {"prompt": "x", "temperature": float("nan")}, "temperature: Input should be a finite number"),
    (CompletionBody, {"prompt": "x", "top_p": float("inf")}, "top_p: Input should be a finite number"),
    (CompletionBody, {"prompt": "a\ud800"}, "prompt: Value error, not valid UTF-8 (a lone surrogate at character 1)"),
    (ChatBody, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content: Value error, not valid UTF-8"),
    (GenerateBody, {"prompt": "ok", "model": "\ud800"}, "model: Value error, not valid UTF-8"),
    (CompletionBody, {"prompt": "x", "stop": ["s"] * 17}, "List should have at most 16 items"),
    (CompletionBody, {"prompt": "x", "stop": "s" * 257}, "String should have at most 256 characters"),
    (CompletionBody, {"prompt": "x", "stop": [""]}, "String should have at least 1 character"),
])
def test_bodies_that_would_break_a_step_are_refused_saying_where(model, body, message):
    said = _refusal(model, body)
    assert said.startswith("invalid request: ") and message in said
    assert "\ud800" not in said and "\udfff" not in said  # never the input itself


@pytest.mark.parametrize("model,body,field", [
    (CompletionBody, {"prompt": "x", "temperature": "0.5"}, "temperature"),
    (CompletionBody, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (CompletionBody, {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    (CompletionBody, {"prompt": "x", "stream": "yes"}, "stream"),
    (CompletionBody, {"prompt": "x", "logprobs": True}, "logprobs"),
    (ChatBody, {"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
])
def test_a_value_of_another_type_is_refused_not_converted(model, body, field):
    """As OpenAI's API: a string for a number, a float or a boolean for a count, a string for a flag."""
    assert f"{field}: " in _refusal(model, body)


def test_an_integer_passes_for_a_number_and_null_is_the_default():
    assert CompletionBody(prompt="x", temperature=1, top_p=1).sampling()["temperature"] == 1.0
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "temperature": None, "n": None,
                                    "top_p": None, "stream": None, "max_tokens": None})
    assert (body.sampling()["temperature"], body.sampling()["top_p"], body.n, body.stream) == (1.0, 1.0, 1, False)
    assert "unknown: not supported by this server" in _refusal(CompletionBody, {"prompt": "x", "unknown": None})


def test_bounded_stop_lists_pass():
    body = CompletionBody(prompt="x", stop=["s" * 256] * 16)
    assert body.sampling()["stop"] == ["s" * 256] * 16


def test_concurrent_reservations_never_overdraw_a_quota():
    guard = Guard(["k"], quota_tokens=60)
    at_once = threading.Barrier(12)
    answers = []

    def reserve():
        at_once.wait()
        answers.append(guard.reserve("k", 10))

    threads = [threading.Thread(target=reserve) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers.count(None) == 6 and sorted(a for a in answers if a is not None) == [0] * 6
    assert guard.used == {"k": 60}
    guard.refund("k", 25)
    assert guard.reserve("k", 26) == 25 and guard.reserve("k", 25) is None and guard.used == {"k": 60}


def test_without_a_quota_or_a_key_nothing_is_reserved():
    assert Guard(["k"]).reserve("k", 10 ** 9) is None and Guard(quota_tokens=5).reserve(None, 10) is None
