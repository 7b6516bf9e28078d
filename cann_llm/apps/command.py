"""What the applications' commands share: --port, --max_new_tokens and --max-body-bytes checked as
`cann-run serve` checks its own, the model checked before anything is served (`open_chat_model`), and the
service run on a socket taken first, its startup line naming where it really listens."""

from __future__ import annotations

import socket

import click

from cann_llm.runtime.errors import AtcError, invalid_value

MAX_BODY_BYTES = 1024 * 1024  # well above the largest valid body: 32,000 characters, each a 12-byte JSON escape

HOST = click.option("--host", default="127.0.0.1", show_default=True)
MAX_BODY = click.option("--max-body-bytes", type=click.IntRange(min=1024), default=MAX_BODY_BYTES, show_default=True,
                        help="largest request body accepted; a larger one gets 413")


def port_option(default: int):
    """--port, a TCP port (0: any free one, which the startup line names)."""
    return click.option("--port", type=click.IntRange(0, 65535), default=default, show_default=True,
                        help="0: any free port")


def max_new_tokens_option(default: int):
    """--max_new_tokens, at least 1 (whether the model's context has room for it is checked once it loads)."""
    return click.option("--max_new_tokens", type=click.IntRange(min=1), default=default, show_default=True,
                        help="the longest answer, in tokens")


def open_chat_model(model: str, max_new_tokens: int, shortest: list[dict]):
    """The engine of `model` once it is known to take requests: it has a tokenizer and a chat template, and
    its context holds `shortest` (the messages of the application's shortest request) with `max_new_tokens`
    for the answer. AtcError otherwise, the engine closed: a service that could answer nothing is not
    started."""
    # imported here: loading a model pulls in the runtime, which `--help` and a refused flag never need
    from cann_llm.cli.llm_commands import open_engine

    engine = open_engine(model)
    try:
        try:
            shortest_tokens = len(engine.chat_prompt(shortest))
        except ValueError as error:  # compiled without a tokenizer: no text can be asked of it
            raise AtcError("E10001", model, "--model", str(error)) from None
        room = engine.max_context_len - shortest_tokens
        if max_new_tokens > room:
            raise invalid_value(max_new_tokens, "max_new_tokens",
                                f"the model's context holds {engine.max_context_len} tokens and the shortest request "
                                f"takes {shortest_tokens}: at most {max(room, 0)} are left for the answer")
    except BaseException:
        engine.close()
        raise
    return engine


def serve_on(listener: socket.socket, app, banner: str) -> None:
    """Serve `app` on `listener` until interrupted, having said `banner` on stderr with `{url}` replaced by
    where it listens (the port the system chose, for --port 0)."""
    import uvicorn

    host, port = listener.getsockname()[:2]
    click.echo(banner.format(url=f"http://{f'[{host}]' if ':' in host else host}:{port}"), err=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
