"""`cann-run serve` in its own process on 127.0.0.1, as users start it, for the HTTP tests."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StderrLines:
    """A process's stderr line by line as it comes (read in a thread, so the pipe never fills)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.ended = False
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._arrived:
                self.lines.append(line.rstrip("\n"))
                self._arrived.notify_all()
        with self._arrived:
            self.ended = True
            self._arrived.notify_all()

    def wait_for(self, wanted, timeout: float = 120) -> str:
        """The first line `wanted(line)` accepts, once it has been printed (fails at once if the stream ends
        without it)."""
        def found():
            return next((line for line in self.lines if wanted(line)), None) or self.ended

        with self._arrived:
            line = self._arrived.wait_for(found, timeout)
        assert isinstance(line, str), f"no such line in {self.lines}"
        return line

    def all(self, timeout: float = 60) -> str:
        """Everything the process wrote, once it has closed the stream (it has exited)."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: self.ended, timeout), "the stream is still open"
            return "\n".join(self.lines)


class Server:
    def __init__(self, *argv: str):
        # the server binds a port of its own and names it when ready: a port chosen here could be taken by
        # another process before the server binds it
        self.process = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", "0", *argv],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, encoding="utf-8")
        self.stderr = StderrLines(self.process.stderr)
        # a hang guard, not a speed bound: a crash ends the stream (and the wait) at once
        ready = self.stderr.wait_for(lambda line: line.startswith("ready in "), timeout=600)
        self.url = re.search(r"http://127\.0\.0\.1:\d+", ready)[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            labelled = line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
            if labelled or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{{{selector}}}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
