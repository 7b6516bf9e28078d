"""The FastAPI application: the seed's `/generate`, OpenAI's completions and chat completions (with SSE
streaming), `/v1/models`, `/health` and Prometheus `/metrics`, over one LLMEngine per model.

Every request is admitted or refused before any work: 401 without a valid key, 404 for an unknown
model, 429 (with Retry-After) when its key's quota is spent or the model's queue is full, 400 for a
blocked or over-long prompt, 422 for a malformed body. Once admitted it ends as completed, cancelled
(client gone, or 504 on timeout) or failed, and its pages go back to the pool either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runtime.engine.engine import LLMEngine
from runtime.serving.guard import Guard
from runtime.serving.metrics import ServerMetrics
from runtime.serving.schemas import ChatBody, CompletionBody, GenerateBody


@dataclass
class ServerSettings:
    """Limits of the service."""

    max_pending: int = 256          # requests admitted per model (running + waiting) before 429
    request_timeout_s: float = 300.0
    shutdown_grace_s: float = 10.0
    retry_after_s: int = 1


class _Models:
    """The engines, loaded in the background so /health can say 503 until they are ready."""

    def __init__(self, paths: dict[str, str], engine_kwargs: dict):
        self.paths, self.engine_kwargs = paths, engine_kwargs
        self.engines: dict[str, LLMEngine] = {}
        self.pending = dict.fromkeys(paths, 0)
        self.ready = threading.Event()
        self.error: str | None = None
        self.metrics: ServerMetrics | None = None

    def load(self) -> None:
        # one engine per file, whatever it is called: the same artifact under two names is loaded once
        by_file: dict[tuple[int, int], LLMEngine] = {}
        try:
            for name, path in self.paths.items():
                stat = os.stat(path)
                identity = (stat.st_dev, stat.st_ino)
                if identity not in by_file:
                    by_file[identity] = LLMEngine(path, **self.engine_kwargs)
                self.engines[name] = by_file[identity]
            self.metrics = ServerMetrics(self.engines)
        except Exception as error:  # reported by /health; the process stays up to say so
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.ready.set()


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def create_app(model_paths: dict[str, str], settings: ServerSettings | None = None, guard: Guard | None = None,
               **engine_kwargs) -> FastAPI:
    """The application serving `model_paths` ({name: .om path})."""
    settings = settings or ServerSettings()
    guard = guard or Guard()
    models = _Models(model_paths, engine_kwargs)
    state = {"closing": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=models.load, name="model-loader", daemon=True).start()
        yield
        state["closing"] = True
        deadline = time.monotonic() + settings.shutdown_grace_s
        while sum(models.pending.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for engine in set(models.engines.values()):
            engine.close()  # what is still running is cancelled, its pages freed
        guard.close()

    app = FastAPI(title="cann-llm", lifespan=lifespan)

    def metrics() -> ServerMetrics:
        return models.metrics  # made with the engines; nothing reaches here before they are ready

    @app.get("/health")
    async def health():
        if not models.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if models.error:
            return JSONResponse({"status": "error", "error": models.error}, status_code=503)
        return {"status": "ok", "models": sorted(models.engines)}

    @app.get("/metrics")
    async def scrape():
        if not models.ready.is_set() or models.error:
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse(generate_latest(metrics().registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(http: Request):
        key, refusal = guard.authorise(http.headers.get("authorization"))
        if refusal:
            return _error(401, refusal, "authentication_error")
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "cann-llm"}
                                           for name in sorted(models.engines)]}

    def admit(http: Request, name: str | None):
        """(engine name, key) for an admitted request, or the refusal to return."""
        if state["closing"]:
            return None, None, _error(503, "the server is shutting down", "unavailable")
        if not models.ready.is_set() or models.error:
            return None, None, _error(503, "the models are still loading", "unavailable")
        key, refusal = guard.authorise(http.headers.get("authorization"))
        if refusal:
            return None, None, _error(401, refusal, "authentication_error")
        name = name or next(iter(models.engines))
        if name not in models.engines:
            return None, None, _error(404, f"model {name!r} is not served; see /v1/models", "invalid_request_error")
        if not guard.quota_left(key):
            metrics().rejected(name)
            return None, None, _error(429, "the token quota of this key is spent", "quota_exceeded",
                                      {"Retry-After": str(settings.retry_after_s)})
        if models.pending[name] >= settings.max_pending:
            metrics().rejected(name)
            return None, None, _error(429, "the server is at capacity; retry shortly", "rate_limit_exceeded",
                                      {"Retry-After": str(settings.retry_after_s)})
        return name, key, None

    def submit(name: str, key, prompt, params: dict):
        """Submit to the engine; (request, None) or (None, a 400 refusal)."""
        text = prompt if isinstance(prompt, str) else ""
        term = guard.blocked(text)
        if term:
            metrics().rejected(name)
            return None, _error(400, "the prompt contains blocked content", "content_filter")
        stop = list(params.pop("stop") or ())
        try:
            request = models.engines[name].submit(prompt, stop=stop + list(guard.blocked_terms), **params)
        except ValueError as error:
            metrics().rejected(name)
            return None, _error(400, str(error), "invalid_request_error")
        models.pending[name] += 1
        return request, None

    def finish_reason(request) -> str:
        detok = request.detokenizer
        if detok is not None and detok.matched_stop in guard.blocked_terms:
            return "content_filter"
        return "length" if request.finish_reason == "length" else "stop"

    def settle(name: str, key, request, endpoint: str, status: int, outcome: str) -> None:
        models.pending[name] -= 1
        stats = request.stats
        metrics().finished(name, stats, finish_reason(request), outcome)
        guard.charge(key, stats.prompt_tokens + stats.output_tokens)
        guard.audit(key, name, endpoint, status, stats.prompt_tokens, stats.output_tokens, stats.total_s or 0.0)

    async def wait(http: Request, request) -> str:
        """The request's outcome: completed, cancelled (client gone) or timeout."""
        future = asyncio.wrap_future(request.future)
        deadline = time.monotonic() + settings.request_timeout_s
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.25)
            if done:
                return "completed" if request.finish_reason != "cancelled" else "cancelled"
            if await http.is_disconnected():
                request.cancel()
                await asyncio.wrap_future(request.future)
                return "cancelled"
            if time.monotonic() > deadline:
                request.cancel()
                await asyncio.wrap_future(request.future)
                return "timeout"

    async def respond(http: Request, name, key, request, endpoint: str, body_of):
        try:
            outcome = await wait(http, request)
        except Exception:
            settle(name, key, request, endpoint, 500, "failed")
            return _error(500, "generation failed", "server_error")
        if outcome == "timeout":
            settle(name, key, request, endpoint, 504, "cancelled")
            return _error(504, f"the request took longer than {settings.request_timeout_s:g} s", "timeout")
        if outcome == "cancelled":
            settle(name, key, request, endpoint, 499, "cancelled")
            return _error(499, "the client closed the request", "cancelled")
        settle(name, key, request, endpoint, 200, "completed")
        return body_of(request)

    def stream(name, key, request, endpoint: str, chunk_of, first: list[str] | None = None):
        async def events():
            outcome, status, ended = "cancelled", 499, False
            try:
                for opening in first or ():
                    yield f"data: {opening}\n\n"
                async for piece in request.aiter_text():
                    yield f"data: {chunk_of(piece, None)}\n\n"
                # decided before the last yields: a client may close as soon as it reads [DONE]
                ended = True
                outcome, status = ("completed", 200) if request.finish_reason != "cancelled" else ("cancelled", 499)
                yield f"data: {chunk_of('', finish_reason(request))}\n\n"
                yield "data: [DONE]\n\n"
            except Exception:
                outcome, status = "failed", 500
                raise
            finally:
                # no awaiting here (this task may be being cancelled): settle once the engine is done with it
                request.future.add_done_callback(lambda _: settle(name, key, request, endpoint, status, outcome))
                if not ended:
                    request.cancel()  # the client went away mid-stream

        return StreamingResponse(events(), media_type="text/event-stream")

    def sampling(body) -> dict:
        return {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
                "repetition_penalty": body.repetition_penalty,
                "stop": [body.stop] if isinstance(body.stop, str) else body.stop}

    def usage(request) -> dict:
        stats = request.stats
        return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.output_tokens,
                "total_tokens": stats.prompt_tokens + stats.output_tokens}

    def start(http: Request, name: str | None, prompt, params: dict, messages: list[dict] | None = None):
        """Admit and submit one generation: (name, key, request, None) or (.., refusal)."""
        name, key, refusal = admit(http, name)
        if refusal:
            return name, key, None, refusal
        if messages is not None:
            if guard.blocked(" ".join(m["content"] for m in messages)):
                metrics().rejected(name)
                return name, key, None, _error(400, "the prompt contains blocked content", "content_filter")
            try:
                prompt = models.engines[name].chat_prompt(messages)
            except Exception as error:
                metrics().rejected(name)
                return name, key, None, _error(400, f"the chat template cannot render these messages: {error}",
                                               "invalid_request_error")
        request, refusal = submit(name, key, prompt, params)
        return name, key, request, refusal

    @app.post("/generate")
    async def generate(body: GenerateBody, http: Request):
        name, key, request, refusal = start(http, body.model, body.prompt, {
            "max_new_tokens": body.max_length, "temperature": body.temperature, "stop": None})
        if refusal:
            return refusal
        return await respond(http, name, key, request, "/generate", lambda r: {
            "text": r.text, "inference_time_ms": round((r.stats.total_s or 0) * 1000, 1),
            "prompt_tokens": r.stats.prompt_tokens, "completion_tokens": r.stats.output_tokens,
            "finish_reason": finish_reason(r)})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        name, key, request, refusal = start(http, body.model, body.prompt,
                                            {"max_new_tokens": body.max_tokens, **sampling(body)})
        if refusal:
            return refusal
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def completion(text: str, reason) -> dict:
            return {"id": ident, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        if body.stream:
            return stream(name, key, request, "/v1/completions", lambda text, reason: json.dumps(completion(text, reason)))
        return await respond(http, name, key, request, "/v1/completions",
                             lambda r: {**completion(r.text, finish_reason(r)), "usage": usage(r)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        limit = body.max_completion_tokens or body.max_tokens or 256
        name, key, request, refusal = start(http, body.model, None, {"max_new_tokens": limit, **sampling(body)},
                                            messages=[m.model_dump() for m in body.messages])
        if refusal:
            return refusal
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def reply(kind: str, part: dict, reason) -> dict:
            return {"id": ident, "object": kind, "created": created, "model": name,
                    "choices": [{"index": 0, **part, "finish_reason": reason}]}

        if body.stream:
            opening = json.dumps(reply("chat.completion.chunk", {"delta": {"role": "assistant", "content": ""}}, None))
            return stream(name, key, request, "/v1/chat/completions", lambda text, reason: json.dumps(
                reply("chat.completion.chunk", {"delta": {"content": text} if text else {}}, reason)), [opening])
        return await respond(http, name, key, request, "/v1/chat/completions", lambda r: {
            **reply("chat.completion", {"message": {"role": "assistant", "content": r.text}}, finish_reason(r)),
            "usage": usage(r)})

    return app
