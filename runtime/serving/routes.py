"""The HTTP routes over a `Server`: the seed's `/generate`, OpenAI's completions and chat completions (with
SSE streaming), `/v1/models`, `/health` and Prometheus `/metrics`. Each parses its body (400 when it is
malformed, 413 past `--max-body-bytes`), calls the Server, and serialises what it returns or the `Refusal`
it raises. Admission (tokenizing the prompt included) runs on a worker thread, so a long prompt never holds
up the event loop and /health."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from runtime.serving.body_limit import BodyLimit
from runtime.serving.server import Generation, Refusal, Server
from runtime.serving.wire import (ChatBody, ChatCompletion, Completion, CompletionBody, GenerateBody, error_body,
                                  generate_response, usage, validation_error_body)


def create_app(server: Server) -> FastAPI:
    """The application answering for `server` (which its owner loads and drains)."""
    app = FastAPI(title="cann-llm")
    app.add_middleware(BodyLimit, max_bytes=server.settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def malformed(_, error: RequestValidationError):
        return _json(validation_error_body(list(error.errors())), 400)

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

    @app.get("/metrics")
    async def scrape():
        if server.metrics is None:  # not loaded (yet)
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(http: Request):
        try:
            server.authorise(http.headers.get("authorization"))
        except Refusal as refusal:
            return _refused(refusal)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "cann-llm"}
                                           for name in server.model_names()]}

    @app.post("/generate")
    async def generate(body: GenerateBody, http: Request):
        try:
            generation = await _start(server, http, body.model, "/generate", body.sampling(), prompt=body.prompt)
            done = await server.complete(generation, http.is_disconnected)
        except Refusal as refusal:
            return _refused(refusal)
        stats = done.request.stats
        return generate_response(done.text, stats.total_s or 0.0, stats.prompt_tokens, stats.output_tokens,
                                 done.finish_reason)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        try:
            generation = await _start(server, http, body.model, "/v1/completions", body.sampling(),
                                      prompt=body.prompt)
        except Refusal as refusal:
            return _refused(refusal)
        return await _answer(server, http, generation, Completion(generation.model), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        try:
            generation = await _start(server, http, body.model, "/v1/chat/completions", body.sampling(),
                                      messages=body.message_dicts())
        except Refusal as refusal:
            return _refused(refusal)
        return await _answer(server, http, generation, ChatCompletion(generation.model), body.stream)

    return app


async def _start(server: Server, http: Request, model: str | None, endpoint: str, params: dict,
                 **prompt) -> Generation:
    return await asyncio.to_thread(server.start, http.headers.get("authorization"), model, endpoint, params, **prompt)


def _refused(refusal: Refusal) -> Response:
    headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else None
    return _json(error_body(refusal.status, refusal.message, refusal.kind), refusal.status, headers)


def _json(body: dict, status: int, headers: dict | None = None) -> Response:
    """JSON escaped to ASCII: an error may quote what the client sent, which need not be encodable."""
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


async def _answer(server: Server, http: Request, generation: Generation, shape: Completion | ChatCompletion,
                  stream: bool):
    """The whole body, or its server-sent events."""
    if stream:
        return StreamingResponse(_events(server, generation, shape), media_type="text/event-stream")
    try:
        done = await server.complete(generation, http.is_disconnected)
    except Refusal as refusal:
        return _refused(refusal)
    stats = done.request.stats
    return shape.body(done.text, done.finish_reason, usage(stats.prompt_tokens, stats.output_tokens))


async def _events(server: Server, generation: Generation, shape: Completion | ChatCompletion):
    for opening in shape.opening():
        yield _event(opening)
    try:
        async for piece in server.stream(generation):
            yield _event(shape.chunk(piece, None))
    except Refusal as refusal:  # OpenAI's clients raise on an error event in a stream
        yield _event(error_body(refusal.status, refusal.message, refusal.kind))
    else:
        yield _event(shape.chunk("", generation.finish_reason))
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
