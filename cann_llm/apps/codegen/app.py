"""The code-generation service over HTTP: `POST /generate {"description", "language"}` and `POST /optimize
{"code", "language"}`, each answering `{"code", "valid", "error", "attempts", "answer"}`; `GET /health`.
A request too large (413), malformed or blank (422), or too long for the model's context (422) is refused
with the reason."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import FastAPI
from pydantic import BaseModel, Field

from cann_llm.apps.codegen.service import CodeGenerator
from cann_llm.apps.web import Text, guard


class GenerateBody(BaseModel):
    description: Text = Field(min_length=1, max_length=8000)
    language: Text = Field("python", min_length=1, max_length=32)


class OptimizeBody(BaseModel):
    code: Text = Field(min_length=1, max_length=32000)
    language: Text = Field("python", min_length=1, max_length=32)


def create_app(generator: CodeGenerator, max_body_bytes: int) -> FastAPI:
    """The service answering with `generator` (its engine runs each request on its own thread); bodies over
    `max_body_bytes` get 413."""
    app = guard(FastAPI(title="cann-llm codegen"), max_body_bytes)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/generate")
    async def generate(body: GenerateBody):
        return asdict(await asyncio.to_thread(generator.generate_code, body.description, body.language))

    @app.post("/optimize")
    async def optimize(body: OptimizeBody):
        return asdict(await asyncio.to_thread(generator.optimize_code, body.code, body.language))

    return app
