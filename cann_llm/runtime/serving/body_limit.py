"""`BodyLimit`: an ASGI middleware that answers 413 (OpenAI's error shape) to a request body over the limit,
told by its Content-Length before any of it is kept, or counted as it arrives when it is chunked.

The rest of the body is read and dropped before the answer (up to `DRAIN_BYTES`): a server that answers
and closes while the client is still sending resets the connection, and the client sees a broken pipe
instead of the 413."""

from __future__ import annotations

import json

from cann_llm.runtime.serving.wire import error_body

DRAIN_BYTES = 64 * 1024 * 1024


async def drain(receive) -> bool:
    """Read and drop what is left of a request's body (within `DRAIN_BYTES`); False when the client left
    meanwhile (nobody to answer)."""
    dropped = 0
    while dropped < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return False
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return True


class BodyLimit:
    """Wraps an ASGI app: HTTP request bodies of more than `max_bytes` get 413 and never reach it whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(receive, send)
            return
        received = 0
        answered = False  # by us, with the 413: what the app sends after that is dropped

        async def counted_receive():
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # the app sees the client leave (raising inside its body reader would be its own 400)
                    answered = True
                    if message.get("more_body", False):
                        await self._refuse(receive, send)
                    else:
                        await self._answer(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not answered:
                await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _refuse(self, receive, send) -> None:
        """Drop what is left of the body (within `DRAIN_BYTES`), then answer 413."""
        if await drain(receive):
            await self._answer(send)

    async def _answer(self, send) -> None:
        body = json.dumps(error_body(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                                     "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
