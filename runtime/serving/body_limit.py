"""`BodyLimit`: an ASGI middleware that answers 413 (OpenAI's error shape) to a request body over the limit,
told by its Content-Length before any of it is read, or counted as it arrives when it is chunked."""

from __future__ import annotations

import json

from runtime.serving.wire import error_body


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
            await self._refuse(send)
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
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not answered:
                await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                                     "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
