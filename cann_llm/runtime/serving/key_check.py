"""`KeyCheck`: an ASGI middleware that answers 401 (OpenAI's error shape) to a request without a valid API key
before its body is parsed, validated or tokenized, so that a caller without a key learns nothing about what the
server would have made of the body, and the server spends nothing on it (vLLM checks keys the same way)."""

from __future__ import annotations

import json
from collections.abc import Callable

from cann_llm.runtime.serving.body_limit import drain
from cann_llm.runtime.serving.guard import Guard
from cann_llm.runtime.serving.wire import error_body

# what anyone may ask without a key, as in vLLM: liveness, the scrape, and the API's own description
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class KeyCheck:
    """Wraps an ASGI app: with keys configured in `guard`, an HTTP request to any path but OPEN_PATHS needs
    `Authorization: Bearer <key>` with one of them; without it, 401 and the app never sees the request.
    `refused(authorization, path)` is told of each refusal (the audit log)."""

    def __init__(self, app, guard: Guard, refused: Callable[[str | None, str], None]):
        self.app, self.guard, self.refused = app, guard, refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.guard.api_keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(b"authorization")
        authorization = raw.decode("latin-1") if raw is not None else None
        _, reason = self.guard.authorise(authorization)
        if reason is None:
            await self.app(scope, receive, send)
            return
        self.refused(authorization, scope["path"])
        # read what the client still sends first: answered mid-upload, it would see a reset, not the 401
        if not await drain(receive):
            return  # the client left: nobody to answer
        body = json.dumps(error_body(401, reason, "authentication_error")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
