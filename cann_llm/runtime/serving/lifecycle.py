"""A `Server` as a process: uvicorn listening on HOST:PORT while the models load beside it, a ready line
once both are up, a stats line every interval, and SIGTERM or SIGINT draining the Server before uvicorn
begins its own shutdown.

uvicorn on its own waits `timeout_graceful_shutdown` for open connections, then cancels their tasks, and
only then tells the application to shut down: the requests still running were cut (500s, truncated
streams, tracebacks in the log) before any drain could answer them. Here the first signal drains the
Server (stop admitting, let in-flight work finish within the grace period, end the rest with a 503), and
only then is uvicorn told to exit, when every request has its answer and only the bytes remain to flush.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Callable

import uvicorn

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.serving.routes import create_app
from cann_llm.runtime.serving.server import Server
from cann_llm.runtime.serving.stats_line import StatsLines

FLUSH_TIMEOUT_S = 10  # uvicorn's graceful timeout: it starts once the drain has answered every request
# an idle connection is kept this long (nginx's default). uvicorn's own 5 s is httpx's (so the openai SDK's)
# keep-alive expiry: a client reusing a connection as its fifth second ends met a server closing it, and its
# request failed with "Server disconnected without sending a response"; held longer, the client lets go first
KEEP_ALIVE_S = 75


def serve(server: Server, host: str, port: int, stats_interval_s: float, say: Callable[[str], None],
          access_log: bool = False) -> None:
    """Serve `server` until SIGTERM or SIGINT (a second one stops waiting); `say` prints a log line.

    Says `loading <models> (<path>) …` as each engine starts loading, `ready in N.N s: http://HOST:PORT
    (models: …)` once every engine has loaded and the socket listens, then every `stats_interval_s`
    seconds (0: never) a stats line per engine whose state changed. AtcError E10001 when HOST:PORT
    cannot be listened on, before anything loads. `access_log`: uvicorn's line per request, on stdout."""
    listener = listen(host, port)
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT_S, timeout_keep_alive=KEEP_ALIVE_S)
    if access_log:  # uvicorn's own warnings only, but each request's line (at INFO)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    _Process(config, server, stats_interval_s, say).run(sockets=[listener])


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on HOST:PORT, taken before anything loads so that a port in use fails at once;
    E10001 when it cannot be had. `::`, every address, takes IPv4's too where the system can (as
    `python -m http.server --bind ::` does): on its own an IPv6 socket is made IPv6-only."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    both = host == "::" and socket.has_dualstack_ipv6()
    try:
        return socket.create_server((host, port), family=family, dualstack_ipv6=both)
    except OSError as error:  # taken, not ours to take, or no such address
        raise AtcError("E10001", f"{host}:{port}", "--host/--port", error.strerror or str(error)) from None


class _Process(uvicorn.Server):
    """uvicorn, with the models loading during its startup and a drain before its shutdown."""

    def __init__(self, config: uvicorn.Config, server: Server, stats_interval_s: float, say: Callable[[str], None]):
        super().__init__(config)
        self.server, self.stats_interval_s, self.say = server, stats_interval_s, say
        self._began = time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task] = set()

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        loaded = asyncio.Event()
        threading.Thread(target=self._load, args=(loaded,), name="model-loader", daemon=True).start()
        await super().startup(sockets)
        if self.started:
            self._spawn(self._announce(loaded))

    def _load(self, loaded: asyncio.Event) -> None:
        self.server.load(lambda names, path: self.say(f"loading {', '.join(names)} ({path}) …"))
        try:
            self._loop.call_soon_threadsafe(loaded.set)
        except RuntimeError:  # the loop is gone: the process stopped before its models were loaded
            pass

    async def _announce(self, loaded: asyncio.Event) -> None:
        await loaded.wait()
        if self.server.closing:  # told to stop while loading: it never was ready
            return
        if self.server.error:
            self.say(f"the models could not be loaded ({self.server.error}); /health reports it")
            return
        for line in self.server.pool_lines():
            self.say(line)
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        port = self.servers[0].sockets[0].getsockname()[1]
        self.say(f"ready in {time.perf_counter() - self._began:.1f} s: http://{host}:{port} "
                 f"(models: {', '.join(self.server.model_names())})")
        if self.stats_interval_s <= 0:
            return
        stats = StatsLines(self.server.engines)
        while not self.server.closing:
            await asyncio.sleep(self.stats_interval_s)
            for line in stats.lines():
                self.say(line)

    def handle_exit(self, sig, frame) -> None:
        if self._draining and self.server.stop_waiting():  # a second signal: what still runs ends now (503)
            return
        if self._draining or not self.started:
            super().handle_exit(sig, frame)  # a third signal, or one before listening: uvicorn's own way
            return
        self._draining = True
        # a signal handler may not touch the loop but through its thread-safe door
        self._loop.call_soon_threadsafe(self._spawn, self._drain(sig))

    async def _drain(self, sig) -> None:
        await self.server.drain()
        super().handle_exit(sig, None)  # uvicorn's shutdown, and the signal re-raised once it is over

    def _spawn(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)
