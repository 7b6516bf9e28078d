"""The bot over HTTP: `POST /chat {"conversation_id", "message"}` answers `{"text", "sources", "escalated"}`;
`GET /` is a small chat page (HTML and JavaScript, no build step); `GET /health`. A request too large
(413), malformed or blank (422), or too long for the model's context (422) is refused with the reason."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from cann_llm.apps.customer_service.bot import CustomerServiceBot
from cann_llm.apps.web import Text, guard

PAGE = Path(__file__).with_name("static") / "index.html"


class ChatBody(BaseModel):
    conversation_id: str = Field(min_length=1, max_length=128)
    message: Text = Field(min_length=1, max_length=4000)


def create_app(bot: CustomerServiceBot, max_body_bytes: int) -> FastAPI:
    """The service answering with `bot` (each message on a worker thread; one turn of a conversation at a
    time); bodies over `max_body_bytes` get 413."""
    app = guard(FastAPI(title="cann-llm customer service"), max_body_bytes)

    @app.get("/")
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/chat")
    async def chat(body: ChatBody):
        return asdict(await asyncio.to_thread(bot.answer, body.conversation_id, body.message))

    return app
