"""The HTTP routes over a `Server`: the seed's `/generate`, OpenAI's completions and chat completions (with
SSE streaming, `n` choices, log-probabilities, structured outputs), vLLM's `/tokenize` and `/detokenize`,
`/v1/models`, `/health` and Prometheus `/metrics`. A body past `--max-body-bytes` is 413, then a request
without a valid API key 401, both before the body is parsed; each route parses its body (400 when it is
malformed), calls the Server, and serialises what it returns or the `Refusal` it raises. Admission
(tokenizing the prompt included) runs on a worker thread, so a long prompt never holds up the event loop
and /health."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from starlette.exceptions import HTTPException

from cann_llm.runtime.serving.body_limit import BodyLimit
from cann_llm.runtime.serving.key_check import KeyCheck
from cann_llm.runtime.serving import tools
from cann_llm.runtime.serving.server import Generation, Refusal, Server
from cann_llm.runtime.serving.wire import (BodyError, ChatBody, ChatCompletion, Choice, Completion, CompletionBody,
                                  DetokenizeBody, GenerateBody, TokenizeBody, error_body, generate_response, usage,
                                  validation_error_body)


GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")  # the requests the audit log records


def create_app(server: Server) -> FastAPI:
    """The application answering for `server` (which its owner loads and drains)."""
    app = FastAPI(title="cann-llm")

    def key_refused(authorization: str | None, path: str) -> None:
        if path in GENERATION_PATHS:
            server.refused(authorization, None, path, 401)

    # the last added runs first: the body's size, then the key, both before the body is parsed
    app.add_middleware(KeyCheck, guard=server.guard, refused=key_refused)
    app.add_middleware(BodyLimit, max_bytes=server.settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def malformed(http: Request, error: RequestValidationError):
        if http.url.path in GENERATION_PATHS:
            server.refused(http.headers.get("authorization"), None, http.url.path, 400)
        return _json(validation_error_body(list(error.errors())), 400)

    def refused(http: Request, model: str | None, endpoint: str, refusal: Refusal) -> Response:
        """A generation request's refusal, recorded in the audit log."""
        server.refused(http.headers.get("authorization"), model, endpoint, refusal.status)
        return _refused(refusal)

    @app.exception_handler(HTTPException)
    async def refused_by_the_framework(_, error: HTTPException):
        # a body that cannot be decoded at all (bad encoding, nesting past the parser), an unknown route
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _json(error_body(error.status_code, str(error.detail), kind), error.status_code, error.headers)

    @app.get("/health")
    async def health():
        status = server.status()
        if status == "ok":
            return {"status": "ok", "models": server.model_names()}
        return JSONResponse({"status": status, **({"error": server.error} if server.error else {})},
                            status_code=503)

    # while the models load there are no engines to read, but the process is there: a scrape that failed then
    # would mark the target down for the whole load
    loading = CollectorRegistry()
    ProcessCollector(registry=loading)

    @app.get("/metrics")
    async def scrape():
        registry = loading if server.metrics is None else server.metrics.registry
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(name) for name in server.model_names()]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str):
        if name not in server.model_names():
            return _refused(Refusal(404, f"model {name!r} is not served; see /v1/models", "invalid_request_error",
                                    param="model"))
        return _model_card(name)

    @app.post("/generate")
    async def generate(body: GenerateBody, http: Request):
        try:
            generation, = await server.admit(http.headers.get("authorization"), body.model, "/generate",
                                             body.sampling(), 1, prompt=body.prompt)
        except Refusal as refusal:
            return refused(http, body.model, "/generate", refusal)
        try:
            done = await server.complete(generation, http.is_disconnected)
        except Refusal as refusal:  # ended after admission: the audit has it from the engine's accounting
            return _refused(refusal)
        stats = done.request.stats
        return generate_response(done.text, stats.total_s or 0.0, stats.prompt_tokens, stats.output_tokens,
                                 done.finish_reason)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        try:
            _, _, engine = server.engine_for(http.headers.get("authorization"), body.model)
            if body.echo and engine.tokenizer is None:
                raise Refusal(400, "echo needs the model's tokenizer; recompile with atc --tokenizer=DIR",
                              "invalid_request_error", param="echo")
            generations = await _start(server, http, body, "/v1/completions", prompt=body.prompt)
        except Refusal as refusal:
            return refused(http, body.model, "/v1/completions", refusal)
        echo = (body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(body.prompt)) if body.echo else ""
        shape = _shape(Completion, generations[0], engine, body)
        return await _answer(server, http, generations, shape, body, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        try:
            try:
                conversation = body.conversation_turn()
            except BodyError as error:
                raise Refusal(400, str(error), "invalid_request_error", param=error.param) from None
            generations = await _start(server, http, body, "/v1/chat/completions", messages=body.message_dicts(),
                                       tools=body.tool_dicts(), conversation=conversation)
        except Refusal as refusal:
            return refused(http, body.model, "/v1/chat/completions", refusal)
        engine = server.engines[generations[0].model]
        return await _answer(server, http, generations, _shape(ChatCompletion, generations[0], engine, body), body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody, http: Request):
        try:
            _, _, engine = server.engine_for(http.headers.get("authorization"), body.model)
            if (body.prompt is None) == (body.messages is None):
                raise Refusal(400, "give either prompt or messages", "invalid_request_error", param="prompt")
            try:  # off the event loop: a long prompt takes seconds to tokenize, /health must not wait for it
                ids = await asyncio.to_thread(_tokenized, engine, body)
            except Exception as error:  # a template's own error, or a model without a tokenizer
                raise Refusal(400, f"the prompt cannot be rendered or tokenized: {error}", "invalid_request_error")
        except Refusal as refusal:
            return _refused(refusal)
        return {"count": len(ids), "max_model_len": engine.max_context_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody, http: Request):
        try:
            _, _, engine = server.engine_for(http.headers.get("authorization"), body.model)
            bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise Refusal(400, f"token id {bad} is outside the vocabulary [0, {engine.vocab_size})",
                              "invalid_request_error", param="tokens")
            if engine.tokenizer is None:
                raise Refusal(400, "the model was compiled without a tokenizer", "invalid_request_error")
        except Refusal as refusal:
            return _refused(refusal)
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


async def _start(server: Server, http: Request, body: CompletionBody | ChatBody, endpoint: str,
                 **prompt) -> list[Generation]:
    """The body's `n` choices admitted and submitted."""
    try:
        params = body.sampling()
    except BodyError as error:  # fields that pass one by one but not together
        raise Refusal(400, str(error), "invalid_request_error", param=error.param) from None
    return await server.admit(http.headers.get("authorization"), body.model, endpoint, params, body.n,
                              tokens_asked=body.tokens_asked(), **prompt)


def _tokenized(engine, body: TokenizeBody) -> list[int]:
    if body.messages is not None:
        text = engine.chat_text([m.for_template() for m in body.messages], body.add_generation_prompt)
        return engine.tokenizer.encode(text, add_special_tokens=False)
    return engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "cann-llm"}


def _shape(kind: type[Completion], generation: Generation, engine, body: CompletionBody | ChatBody) -> Completion:
    """An answer's shapes, spelling tokens with the model's tokenizer (as their ids without one). Token ids
    are returned when asked for, and always by a model without a tokenizer, whose text is empty."""
    seq = generation.request.seq
    prompt_ids = tuple(seq.token_ids[:seq.num_prompt]) if body.return_token_ids or engine.tokenizer is None else None
    if engine.tokenizer is None:
        return kind(generation.model, prompt_ids=prompt_ids)
    return kind(generation.model, engine.tokenizer.token_text, engine.tokenizer.token_bytes,
                engine.tokenizer.token_chars, prompt_ids=prompt_ids)


def _refused(refusal: Refusal) -> Response:
    headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else None
    if refusal.final:  # the openai SDK retries a 429 or 503 by itself unless told not to
        headers = {**(headers or {}), "x-should-retry": "false"}
    return _json(error_body(refusal.status, refusal.message, refusal.kind, refusal.param), refusal.status, headers)


def _json(body: dict, status: int, headers: dict | None = None) -> Response:
    """JSON escaped to ASCII: an error may quote what the client sent, which need not be encodable."""
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def _logprobs(generation: Generation) -> list | None:
    """Each token's log-probabilities, when asked for: of the tokens whose text was returned."""
    seq = generation.request.seq
    return list(seq.logprobs[:generation.tokens_in_text()]) if seq.params.logprobs is not None else None


def _prompt_logprobs(generation: Generation) -> list | None:
    """The echoed prompt's tokens scored (the first without a log-probability), when logprobs are asked for."""
    seq = generation.request.seq
    return list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None


def _usage(generations: list[Generation]) -> dict:
    return usage(generations[0].request.stats.prompt_tokens, sum(g.request.stats.output_tokens for g in generations))


async def _answer(server: Server, http: Request, generations: list[Generation], shape: Completion,
                  body: CompletionBody | ChatBody, echo: str = ""):
    """The whole body, or its server-sent events."""
    if body.stream:
        return StreamingResponse(_events(server, generations, shape, body, echo), media_type="text/event-stream")
    try:
        await server.complete_all(generations, http.is_disconnected)
    except Refusal as refusal:
        return _refused(refusal)
    choices = [_choice(body, g, echo) for g in generations]
    if shape.prompt_ids is not None:
        for choice, generation in zip(choices, generations):
            choice.token_ids = list(generation.request.output_ids)
    return shape.body(choices, _usage(generations))


def _choice(body: CompletionBody | ChatBody, generation: Generation, echo: str = "") -> Choice:
    """A finished generation as a choice: its text, or the tool calls read out of it."""
    if not isinstance(body, ChatBody) or not body.calls_tools:
        logprobs = _logprobs(generation)
        if logprobs is not None and echo:
            logprobs = _prompt_logprobs(generation) + logprobs
        return Choice(echo + generation.text, generation.finish_reason, logprobs)
    choice = body.choice()
    try:
        content, calls = tools.parse(generation.text, body.tool_dicts(), choice, body.parallel_tool_calls)
    except ValueError:  # a forced call cut short by max_tokens: the text as it is
        return Choice(generation.text, generation.finish_reason, _logprobs(generation))
    forced = isinstance(choice, dict)
    reason = "tool_calls" if calls and not forced and generation.finish_reason == "stop" else generation.finish_reason
    return Choice(content, reason, _logprobs(generation), calls or None)


async def _events(server: Server, generations: list[Generation], shape: Completion, body: CompletionBody | ChatBody,
                  echo: str):
    """Each choice's chunks as its text comes (choices interleaved), its finish, then the usage when asked
    for and `[DONE]`. A choice that may call tools is held to its end and sent as its tool calls (or its
    text, when it called none; the text around its calls first). Leaving early (the client gone) cancels every choice."""
    holding = isinstance(body, ChatBody) and body.calls_tools
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for piece in server.stream(generation):
                await arrived.put((index, piece, None))
            await arrived.put((index, None, None))
        except Refusal as refusal:
            await arrived.put((index, None, refusal))

    pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]

    def framed(payload: dict) -> str:
        """An event with its usage: so far (vLLM's continuous_usage_stats), or null until the last chunk
        carries it (OpenAI's include_usage)."""
        if body.continuous_usage:
            return _event({**payload, "usage": _usage(generations)})
        return _event({**payload, "usage": None} if body.include_usage else payload)

    sent = [0] * len(generations)     # each choice's log-probabilities sent so far
    spelled = [0] * len(generations)  # and the characters of their tokens' text (completions' text_offset)
    spoken = [0] * len(generations)   # and the characters of its text sent
    given = [0] * len(generations)    # and its token ids sent (when they are returned)
    begun = [False] * len(generations)  # whether its first chunk went out

    def chunk(index: int, text: str, reason: str | None, logprobs: list | None = None) -> str:
        offset = spelled[index]
        spelled[index] += sum(shape.token_chars(t.token_id) for t in logprobs or ())
        ids = generations[index].request.output_ids
        upto = len(ids) if reason is not None else generations[index].tokens_in_text(spoken[index])
        fresh, first = ids[given[index]:upto], not begun[index]
        given[index], begun[index] = max(given[index], upto), True
        return framed(shape.chunk(index, text, reason, logprobs, offset, fresh, first))

    def new_logprobs(index: int, finished: bool = False) -> list | None:
        """The log-probabilities of the tokens whose text goes out with this chunk, none ahead of it: the
        engine runs ahead of the stream, and a stream holds back text that may begin a stop string."""
        logprobs = _logprobs(generations[index])
        if logprobs is None:
            return None
        if not finished:
            logprobs = logprobs[:generations[index].tokens_in_text(spoken[index])]
        fresh, sent[index] = logprobs[sent[index]:], max(sent[index], len(logprobs))
        return fresh
    try:
        for index in range(len(generations)):
            opening = shape.opening(index)
            if opening is not None:
                yield framed(opening)
        # the echoed prompt goes out with the choice's first event: by then its tokens are scored
        unechoed, left = set(range(len(generations))) if echo else set(), len(generations)
        while left:
            index, piece, refusal = await arrived.get()
            if refusal is not None:  # OpenAI's clients raise on an error event in a stream
                yield _event(error_body(refusal.status, refusal.message, refusal.kind))
                break
            if index in unechoed:
                unechoed.discard(index)
                yield chunk(index, echo, None, _prompt_logprobs(generations[index]))
            if piece is None:
                left -= 1
                choice = _choice(body, generations[index]) if holding else None
                if choice is not None and choice.text:
                    yield chunk(index, choice.text, None)
                if choice is not None and choice.tool_calls:
                    yield framed(shape.calls_chunk(index, choice.tool_calls))
                reason = choice.finish_reason if choice is not None else generations[index].finish_reason
                yield chunk(index, "", reason, new_logprobs(index, finished=True))
            elif not holding:
                spoken[index] += len(piece)
                yield chunk(index, piece, None, new_logprobs(index))
        else:
            if body.include_usage:
                yield _event(shape.usage_chunk(_usage(generations)))
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:  # a pump cancelled mid-stream ends its choice (server.stream's own cleanup)
            task.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
