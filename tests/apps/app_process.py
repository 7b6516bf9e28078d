"""An application started as its users start it (`python -m apps.<name> ...`) on a free port of 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


@contextmanager
def app_process(*argv: str):
    """Run `python -m *argv --port P`, wait for its /health, yield its URL, stop it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", *argv, "--port", str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600  # a hang guard: a crash is reported at once
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.time() < deadline, process.stderr.read()
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
