"""One HTTP request run through an ASGI application inside this process, its response streamed back in
pieces: how a replica answers what the Ray ingress forwards to it, through the very routes `cann-run serve`
runs on uvicorn (cann_llm/runtime/serving/routes.py), so a replicated deployment answers exactly as one process does.

A forwarded request can be cancelled by its caller (the client went away, or the ingress gave up on it):
closing the generator tells the application the client disconnected and cancels what it still runs, so the
engine ends the generation and frees its pages."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from cann_llm.runtime.serving.wire import error_body

_log = logging.getLogger(__name__)

Asgi = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@dataclass
class HttpCall:
    """A request as the ingress received it, and the text the prefix-aware router places it by."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    routing_text: str = ""            # the prompt or the chat's messages; empty: placed by load alone
    conversation_id: str | None = None  # a server-kept conversation lives in one replica's memory

    @classmethod
    def of(cls, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> "HttpCall":
        """The call, with the routing text read from a JSON body's `messages` or `prompt` (nothing for a
        body that is not JSON: the replica will refuse it)."""
        text, conversation = "", None
        if method == "POST" and body:
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):  # whatever else it holds is the replica's to refuse
                text = routing_text(parsed)
                conversation = parsed.get("conversation_id") if isinstance(parsed.get("conversation_id"), str) else None
        return cls(method, path, query, headers, body, text, conversation)


def routing_text(body: dict) -> str:
    """The text a request's prompt starts with, for prefix matching: the chat messages as role and content in
    order (so two chats share a prefix as far as their rendered prompts do), or the completion's prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):  # content parts: their text in order
                    content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
                parts.append(f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return " ".join(map(str, prompt))
    return ""


@dataclass
class ResponseStart:
    """The status line and headers of a forwarded request's response, sent before its body."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def run_asgi(app: Asgi, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    """Run `call` through `app`: yields its ResponseStart, then the body's pieces as the application sends
    them. Closing the generator early disconnects the client and cancels the application's task."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(call), receive, send)
        except Exception:  # the framework has answered with a 500 already when it could
            _log.exception("the application failed on %s %s", call.method, call.path)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    finished = False
    try:
        started = False
        while True:
            message = await messages.get()
            if message is None:
                if not started:  # the application died before answering
                    yield ResponseStart(500, [(b"content-type", b"application/json")])
                    yield json.dumps(error_body(500, "the replica failed to answer", "server_error")).encode()
                break
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        finished = True
    finally:
        gone.set()
        if finished:
            await task  # only its return is left
        else:
            task.cancel()  # the route's own cancellation ends its generation; run() logs what it raised
            task.add_done_callback(lambda done: done.cancelled() or done.exception())


def _scope(call: HttpCall) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "query_string": call.query, "root_path": "", "headers": call.headers, "client": None, "server": None,
            "state": {}}
