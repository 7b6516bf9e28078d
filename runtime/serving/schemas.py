"""Request bodies of the server's endpoints (pydantic: wrong types are 422 before any work is done)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    repetition_penalty: float = Field(1.0, gt=0)


class GenerateBody(BaseModel):
    """The seed's `/generate`: `{prompt, max_length, temperature}`."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    max_length: int = Field(128, ge=1)
    temperature: float = Field(0.7, ge=0)
    model: str | None = None


class CompletionBody(_Sampling):
    """OpenAI `/v1/completions` (one prompt)."""

    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)


class Message(BaseModel):
    role: str
    content: str


class ChatBody(_Sampling):
    """OpenAI `/v1/chat/completions`."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
