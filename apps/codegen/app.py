"""The code-generation service over HTTP: `POST /generate {"description", "language"}` and `POST /optimize
{"code", "language"}`, each answering `{"code", "valid", "error", "attempts", "answer"}`; `GET /health`."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import FastAPI
from pydantic import BaseModel, Field

from apps.codegen.service import CodeGenerator


class GenerateBody(BaseModel):
    description: str = Field(min_length=1, max_length=8000)
    language: str = Field("python", min_length=1, max_length=32)


class OptimizeBody(BaseModel):
    code: str = Field(min_length=1, max_length=32000)
    language: str = Field("python", min_length=1, max_length=32)


def create_app(generator: CodeGenerator) -> FastAPI:
    """The service answering with `generator` (its engine runs each request on its own thread)."""
    app = FastAPI(title="cann-llm codegen")

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
