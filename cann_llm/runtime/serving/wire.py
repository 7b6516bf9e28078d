"""OpenAI's wire shapes (and the seed's `/generate`): request bodies, what they ask of the engine, and the
response bodies, stream chunks and error bodies the routes send back.

Bodies are pydantic models checked before any work is done: a wrong type, a number that is not finite, a
string that is not valid UTF-8 (a lone surrogate, which JSON can spell) or a stop list past its bounds is a
400 in OpenAI's error shape (`validation_error_body`). What needs the model (token ids within its
vocabulary, a prompt within its context) is the engine's to check.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Callable, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from cann_llm.runtime.chat_template import ROLES, content_text
from cann_llm.runtime.engine.sampling import MAX_LOGPROBS
from cann_llm.runtime.engine.sequence import TokenLogprob
from cann_llm.runtime.engine.structured import StructuredOutput
from cann_llm.runtime.serving import tools

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
# a field the server does not know is refused, naming it: a client asking for something must not believe
# it got it (validation_error_body words it); so is a value of another type than the field's, as OpenAI refuses
# it ("0.5" for a number, 5.0 or true for a count, "yes" for a flag), an integer for a number aside
_BODY = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
_TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]  # OpenAI's logit_bias keys: token ids
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    model_config = _BODY

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    model_config = _BODY

    json_: dict | Text | None = Field(None, alias="json")
    json_object: bool = False
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    def constraint(self) -> StructuredOutput:
        try:
            return StructuredOutput(json=self.json_, json_object=self.json_object, regex=self.regex,
                                    choice=tuple(self.choice) if self.choice is not None else None,
                                    grammar=self.grammar)
        except ValueError as error:
            raise BodyError(str(error), "structured_outputs") from None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)  # OpenAI's own fields (name, ...)

    name: Text = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""

    model_config = _BODY

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class BodyError(ValueError):
    """A body whose fields pass one by one but not together; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Sampling(BaseModel):
    model_config = _BODY

    model: Text | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOPS)
    logit_bias: dict[_TokenKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    user: Text | None = None  # OpenAI's end-user id: recorded nowhere, changes nothing
    priority: int = Field(0, ge=-(2 ** 31), lt=2 ** 31)  # vLLM's: lower is admitted first
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | Text | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, body):
        """A setting given as null is the setting left out, as OpenAI takes it (`"temperature": null`)."""
        if not isinstance(body, dict):
            return body
        return {key: value for key, value in body.items() if value is not None or key not in cls.model_fields}

    def sampling(self) -> dict:
        """The engine's sampling settings this body asks for (one choice's: `n` is the route's)."""
        if self.stream_options is not None and not self.stream:
            raise BodyError("stream_options is only allowed when stream is true", "stream_options")
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "min_tokens": self.min_tokens, "stop_token_ids": tuple(self.stop_token_ids or ()),
                "priority": self.priority,
                "logit_bias": tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
                "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
                "structured_output": self._constraint()}

    def _constraint(self) -> StructuredOutput | None:
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            form = self.response_format
            if form.type == "json_object":
                asked.append(StructuredOutput(json_object=True))
            elif form.json_schema is None:
                raise BodyError("response_format of type json_schema needs its json_schema", "response_format")
            else:
                asked.append(StructuredOutput(json=form.json_schema.schema_ or {"type": "object"}))
        if self.structured_outputs is not None:
            asked.append(self.structured_outputs.constraint())
        guided = {"json": self.guided_json, "regex": self.guided_regex, "grammar": self.guided_grammar,
                  "choice": tuple(self.guided_choice) if self.guided_choice is not None else None}
        for name, value in guided.items():
            if value is not None:
                try:
                    asked.append(StructuredOutput(**{name: value}))
                except ValueError as error:
                    raise BodyError(str(error), f"guided_{name}") from None
        if len(asked) > 1:
            raise BodyError("ask for one structured output: response_format, structured_outputs or one guided_ "
                            "field", "structured_outputs")
        return asked[0] if asked else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: None = None  # OpenAI's insertion mode: only its absence is supported

    def tokens_asked(self) -> tuple[int, str] | None:
        """(`max_tokens`, its field) when the request set it: a prompt and completion past the context are then
        refused, as OpenAI refuses them; the default is cut to what the context leaves."""
        return (self.max_tokens, "max_tokens") if "max_tokens" in self.model_fields_set else None

    def sampling(self) -> dict:
        prompt_logprobs = self.logprobs if self.echo else None  # echoed, the prompt's tokens are scored too
        return {"max_new_tokens": self.max_tokens, "logprobs": self.logprobs, "prompt_logprobs": prompt_logprobs,
                **super().sampling()}


class TextPart(BaseModel):
    model_config = _BODY

    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    model_config = _BODY

    name: Text
    arguments: Text


class ToolCall(BaseModel):
    model_config = _BODY

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(BaseModel):
    model_config = _BODY

    role: Literal[ROLES]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it (content parts joined into one text, as transformers'
        templates that do not loop over parts expect)."""
        content = self.content if not isinstance(self.content, list) else [p.model_dump() for p in self.content]
        said = {"role": self.role, "content": content_text(content)}
        if self.name is not None:
            said["name"] = self.name
        if self.tool_call_id is not None:
            said["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            said["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                  for c in self.tool_calls]
        return said


def _arguments(text: str):
    """A tool call's arguments as templates render them: the object when they are JSON, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(BaseModel):
    model_config = _BODY

    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _BODY

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _BODY

    name: Text


class NamedToolChoice(BaseModel):
    model_config = _BODY

    type: Literal["function"]
    function: NamedFunction


class ChatBody(_Sampling):
    """OpenAI `/v1/chat/completions`."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # this server's extension: the server keeps the conversation's history under this id (cann_llm/runtime/conversation.py)
    conversation_id: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None

    def conversation_turn(self) -> tuple[str, str | None, str] | None:
        """(conversation id, its system message if this request sets one, the user's new turn), when the
        server keeps the history: the request then carries only the new turn (after an optional system
        message), one choice, no tools."""
        if self.conversation_id is None:
            return None
        said = self.message_dicts()
        if said[-1]["role"] != "user" or any(m["role"] not in ("system", "developer") for m in said[:-1]):
            raise BodyError("with conversation_id, messages are the new user turn, after an optional system "
                            "message: the server keeps the rest", "messages")
        if self.n != 1 or self.tools:
            raise BodyError("conversation_id takes one choice and no tools", "conversation_id")
        system = "\n\n".join(m["content"] for m in said[:-1]) or None
        return self.conversation_id, system, said[-1]["content"]

    def tokens_asked(self) -> tuple[int, str] | None:
        """(`max_completion_tokens` or `max_tokens`, the field) when the request set one (see CompletionBody's)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return (self.max_tokens, "max_tokens") if self.max_tokens is not None else None

    def sampling(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise BodyError("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.tool_choice is not None and not self.tools:
            raise BodyError("tool_choice is only allowed when tools are given", "tool_choice")
        said = {"max_new_tokens": (self.tokens_asked() or (256, ""))[0],
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None, **super().sampling()}
        calls = tools.constraint(self.tool_dicts(), self.choice(), self.parallel_tool_calls) if self.tools else None
        if calls is not None:
            if said["structured_output"] is not None:
                raise BodyError("a tool_choice that forces a call cannot be combined with a structured output",
                                "tool_choice")
            said["structured_output"] = calls
        return said

    def choice(self):
        """`tool_choice` as tools.py takes it (OpenAI's default: auto with tools, none without)."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools or ()}:
                raise BodyError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                "tool_choice")
            return choice.model_dump()
        return choice

    def tool_dicts(self) -> list[dict]:
        """The tools as chat templates and tools.py take them."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls."""
        return bool(self.tools) and self.choice() != "none"

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [message.for_template() for message in self.messages]


class TokenizeBody(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages rendered by the template."""

    model_config = _BODY

    model: Text | None = None
    prompt: Text | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    """vLLM's `/detokenize`."""

    model_config = _BODY

    model: Text | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------------


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_error_body(errors: list[dict]) -> dict:
    """OpenAI's 400 for a body pydantic refused: where and why, never the input itself (it may not even
    be encodable). A field the server does not know is named as not supported."""
    said = {}
    for error in errors:  # pydantic names a union's members in the location: only fields and indices are kept
        where = ".".join(str(p) for p in error["loc"][1:] if isinstance(p, int) or str(p).isidentifier())
        if error.get("type") == "json_invalid":  # its location is a character offset into the body, no field
            where = ""

        why = "not supported by this server" if error.get("type") == "extra_forbidden" else error["msg"]
        said.setdefault(where or "body", []).append(why)
    param = next((where for where in said if where != "body"), None)
    said = "; ".join(f"{where}: {' or '.join(why)}" for where, why in list(said.items())[:5])
    return error_body(400, f"invalid request: {said}", "invalid_request_error", param)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` block."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def generate_response(text: str, total_s: float, prompt_tokens: int, completion_tokens: int, reason: str) -> dict:
    """The seed's `/generate` answer."""
    return {"text": text, "inference_time_ms": round(total_s * 1000, 1), "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "finish_reason": reason}


@dataclass
class Choice:
    """One choice of an answer: its text, why it ended, its tokens' log-probabilities when asked for."""

    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[tools.ToolCall] | None = None
    token_ids: list[int] | None = None  # every token it generated, when they are returned


@dataclass(frozen=True)
class Completion:
    """The shapes of one `/v1/completions` answer: its body, or the chunks of its stream. `token_text`
    spells a token id for log-probabilities, `token_bytes` gives the bytes it stands for, `token_chars` the
    characters it adds to the text (none for a special token, which the text leaves out). With `prompt_ids`
    the answer carries token ids as vLLM's `return_token_ids` has them: each choice's `token_ids` (a chunk's:
    those of its text) and the prompt's `prompt_token_ids` (in a stream, in the first chunk)."""

    model: str
    token_text: Callable[[int], str] = str
    token_bytes: Callable[[int], bytes] = lambda token_id: str(token_id).encode()
    token_chars: Callable[[int], int] = lambda token_id: len(str(token_id))
    prompt_ids: tuple[int, ...] | None = None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    kind: ClassVar[str] = "text_completion"

    def opening(self, index: int) -> dict | None:
        """The chunk sent before any text of choice `index` (none for completions)."""
        return None

    def chunk(self, index: int, text: str, reason: str | None, logprobs: list[TokenLogprob] | None = None,
              offset: int = 0, token_ids: list[int] | None = None, first: bool = False) -> dict:
        """A chunk of choice `index`; `first`: the choice's first."""
        return self._frame(self.kind, [{"index": index, "text": text, "logprobs": self._logprobs(logprobs, offset),
                                        "finish_reason": reason, **self._ids(token_ids, first)}])

    def body(self, choices: list[Choice], tokens: dict) -> dict:
        return {**self._frame(self.kind, [{"index": i, "text": c.text, "logprobs": self._logprobs(c.logprobs, 0),
                                           "finish_reason": c.finish_reason, **self._ids(c.token_ids, True)}
                                          for i, c in enumerate(choices)]),
                "usage": tokens}

    def _ids(self, token_ids: list[int] | None, with_prompt: bool) -> dict:
        """A choice's token id fields (none unless they are returned)."""
        if self.prompt_ids is None:
            return {}
        return {**({"prompt_token_ids": list(self.prompt_ids)} if with_prompt else {}), "token_ids": token_ids or []}

    def usage_chunk(self, tokens: dict) -> dict:
        """`stream_options.include_usage`'s last chunk: no choices, the usage of all of them."""
        return {**self._frame(self.kind, []), "usage": tokens}

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> dict | None:
        """Completions' log-probabilities; `text_offset` counts the tokens' text from `offset`, where the
        choice's earlier chunks left off."""
        if logprobs is None:
            return None
        texts = [self.token_text(t.token_id) for t in logprobs]
        lengths = [self.token_chars(t.token_id) for t in logprobs[:-1]]
        offsets = list(itertools.accumulate(lengths, initial=offset)) if texts else []
        return {"tokens": texts, "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [None if t.logprob is None else {self.token_text(i): lp for i, lp in t.top}
                                 for t in logprobs],
                "text_offset": offsets}

    def _frame(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


@dataclass(frozen=True)
class ChatCompletion(Completion):
    """The shapes of one `/v1/chat/completions` answer: its body, or the chunks of its stream."""

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    kind: ClassVar[str] = "chat.completion"

    def opening(self, index: int) -> dict | None:
        """The assistant's role, before any content (the first also with the prompt's ids, when returned)."""
        opening = self._frame("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
        return {**opening, **self._prompt_ids()} if index == 0 else opening

    def chunk(self, index: int, text: str, reason: str | None, logprobs: list[TokenLogprob] | None = None,
              offset: int = 0, token_ids: list[int] | None = None, first: bool = False) -> dict:
        return self._frame("chat.completion.chunk", [{"index": index, "delta": {"content": text} if text else {},
                                                      "logprobs": self._logprobs(logprobs, offset),
                                                      "finish_reason": reason, **self._ids(token_ids, False)}])

    def body(self, choices: list[Choice], tokens: dict) -> dict:
        return {**self._frame(self.kind, [{"index": i, "message": _message(c), "logprobs": self._logprobs(c.logprobs, 0),
                                           "finish_reason": c.finish_reason, **self._ids(c.token_ids, False)}
                                          for i, c in enumerate(choices)]),
                "usage": tokens, **self._prompt_ids()}

    def _prompt_ids(self) -> dict:
        return {} if self.prompt_ids is None else {"prompt_token_ids": list(self.prompt_ids)}

    def calls_chunk(self, index: int, calls: list[tools.ToolCall]) -> dict:
        """The tool calls of choice `index`, as one delta."""
        return self._frame("chat.completion.chunk", [{"index": index, "delta": {"tool_calls": [
            call.as_openai(i) for i, call in enumerate(calls)]}, "logprobs": None, "finish_reason": None}])

    def usage_chunk(self, tokens: dict) -> dict:
        return {**self._frame("chat.completion.chunk", []), "usage": tokens}

    def _logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}
        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in logprobs], "refusal": None}


def _message(choice: Choice) -> dict:
    said = {"role": "assistant", "content": choice.text}
    if choice.tool_calls:
        said["tool_calls"] = [call.as_openai() for call in choice.tool_calls]
    return said
