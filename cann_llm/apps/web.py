"""What the applications' HTTP services share: request bodies limited in size (413, by `cann-run serve`'s
own middleware), validation errors (422) that say where and why but never echo the input back, text fields
refused when blank or not UTF-8, and a request that does not fit the model's context answered 422 with the
reason."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator

from cann_llm.apps.chat_model import DoesNotFit
from cann_llm.apps.text_check import unusable
from cann_llm.runtime.serving.body_limit import BodyLimit


def _usable(text: str) -> str:
    reason = unusable(text)
    if reason is not None:
        raise ValueError(reason)
    return text


Text = Annotated[str, AfterValidator(_usable)]


def guard(app: FastAPI, max_body_bytes: int) -> FastAPI:
    """`app` with bodies over `max_body_bytes` refused, and its validation errors and requests that do not fit
    answered as above."""
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        # FastAPI's own answer, without the `input` it would echo (for a missing field, the whole body)
        return JSONResponse({"detail": [{key: item[key] for key in ("type", "loc", "msg")} for item in error.errors()]},
                            status_code=422)

    @app.exception_handler(DoesNotFit)
    async def too_long(_, error: DoesNotFit):
        return JSONResponse({"detail": str(error)}, status_code=422)

    return app
