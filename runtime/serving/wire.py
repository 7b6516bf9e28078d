"""OpenAI's wire shapes (and the seed's `/generate`): request bodies, what they ask of the engine, and the
response bodies, stream chunks and error bodies the routes send back.

Bodies are pydantic models checked before any work is done: a wrong type, a number that is not finite, a
string that is not valid UTF-8 (a lone surrogate, which JSON can spell) or a stop list past its bounds is a
400 in OpenAI's error shape (`validation_error_body`). What needs the model (token ids within its
vocabulary, a prompt within its context) is the engine's to check.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # each stop string is looked for after every token

# ---- requests ---------------------------------------------------------------------------------------


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"not valid UTF-8 (a lone surrogate at character {error.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
_Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_utf8)]
_BODY = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Sampling(BaseModel):
    model_config = _BODY

    model: Text | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)

    def sampling(self) -> dict:
        """The engine's sampling settings this body asks for."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
                "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ())}


class GenerateBody(BaseModel):
    """The seed's `/generate`: `{prompt, max_length, temperature}`."""

    model_config = _BODY

    prompt: Text
    max_length: int = Field(128, ge=1)
    temperature: float = Field(0.7, ge=0)
    model: Text | None = None

    def sampling(self) -> dict:
        """The engine's settings for this body."""
        return {"max_new_tokens": self.max_length, "temperature": self.temperature, "stop": []}


class CompletionBody(_Sampling):
    """OpenAI `/v1/completions` (one prompt)."""

    prompt: Text | list[int]
    max_tokens: int = Field(16, ge=1)

    def sampling(self) -> dict:
        return {"max_new_tokens": self.max_tokens, **super().sampling()}


class Message(BaseModel):
    model_config = _BODY

    role: Text
    content: Text


class ChatBody(_Sampling):
    """OpenAI `/v1/chat/completions`."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling(self) -> dict:
        return {"max_new_tokens": self.max_completion_tokens or self.max_tokens or 256, **super().sampling()}

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [message.model_dump() for message in self.messages]


# ---- responses --------------------------------------------------------------------------------------


def error_body(status: int, message: str, kind: str) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "code": status}}


def validation_error_body(errors: list[dict]) -> dict:
    """OpenAI's 400 for a body pydantic refused: where and why, never the input itself (it may not even
    be encodable)."""
    said = {}
    for error in errors:  # pydantic names a union's members in the location: only fields and indices are kept
        where = ".".join(str(p) for p in error["loc"][1:] if isinstance(p, int) or str(p).isidentifier())
        said.setdefault(where or "body", []).append(error["msg"])
    said = "; ".join(f"{where}: {' or '.join(why)}" for where, why in list(said.items())[:5])
    return error_body(400, f"invalid request: {said}", "invalid_request_error")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` block."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def generate_response(text: str, total_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> dict:
    """The seed's `/generate` answer."""
    return {"text": text, "inference_time_ms": round(total_s * 1000, 1), "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "finish_reason": reason}


@dataclass(frozen=True)
class Completion:
    """The shapes of one `/v1/completions` answer: its body, or the chunks of its stream."""

    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def opening(self) -> list[dict]:
        """Chunks sent before the first piece of text (none for completions)."""
        return []

    def chunk(self, text: str, reason: str | None) -> dict:
        return self._choice({"text": text, "logprobs": None}, reason)

    def body(self, text: str, reason: str, tokens: dict) -> dict:
        return {**self._choice({"text": text, "logprobs": None}, reason), "usage": tokens}

    def _choice(self, part: dict, reason: str | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, **part, "finish_reason": reason}]}


@dataclass(frozen=True)
class ChatCompletion:
    """The shapes of one `/v1/chat/completions` answer: its body, or the chunks of its stream."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def opening(self) -> list[dict]:
        """The assistant's role, before any content."""
        return [self._choice("chat.completion.chunk", {"delta": {"role": "assistant", "content": ""}}, None)]

    def chunk(self, text: str, reason: str | None) -> dict:
        return self._choice("chat.completion.chunk", {"delta": {"content": text} if text else {}}, reason)

    def body(self, text: str, reason: str, tokens: dict) -> dict:
        return {**self._choice("chat.completion", {"message": {"role": "assistant", "content": text}}, reason),
                "usage": tokens}

    def _choice(self, kind: str, part: dict, reason: str | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **part, "finish_reason": reason}]}
