"""`cann-run serve` in its own process on 127.0.0.1, as users start it, for the HTTP tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, *argv: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "cli.cann_run", "serve", "--port", str(self.port), *argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # a hang guard, not a speed bound: a crash is reported at once below, and a busy host loads slowly
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, self.process.stderr.read()
            time.sleep(0.2)
        raise TimeoutError("the server did not become healthy")

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
