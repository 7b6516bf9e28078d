"""A real `cann-run serve` process of the tiny Llama (compiled paged, with its byte tokenizer) for the
serving soaks (sigterm_soak.py, hostile_soak.py): started on a free port of 127.0.0.1, its stderr kept,
its /metrics read as numbers."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_METRIC = re.compile(r'^cann_llm:(\w+)\{([^}]*)\} ([0-9.e+-]+)$')


def compile_tiny(folder: Path) -> Path:
    """The tiny Llama as a paged `.om` with its tokenizer, compiled into `folder` (once)."""
    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import CompileConfig
    from cann_llm.models.tiny import tiny_onnx

    om = folder / "tiny.om"
    if om.exists():
        return om
    source = tiny_onnx("llama", dynamo=False, with_past=True)
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    shutil.copy(source.with_name("tokenizer.json"), tokenizer / "tokenizer.json")
    config = CompileConfig(model=str(source), framework=5, output=str(folder / "tiny"), soc_version="Ascend910B",
                           enable_paged_attention=True, tokenizer=str(tokenizer))
    return compile_model(config).output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`cann-run serve --model tiny=OM *argv`, healthy when constructed; `stderr` is what it has logged."""

    def __init__(self, om: Path, *argv: str, timeout_s: float = 120):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "cann_llm.cli.cann_run", "serve", "--port", str(self.port),
                                         "--model", f"tiny={om}", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, encoding="utf-8")
        self._lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self._lines.extend(self.process.stderr), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not become healthy:\n{self.stderr}")
            time.sleep(0.1)

    @property
    def stderr(self) -> str:
        return "".join(self._lines)

    def metrics(self) -> dict[str, float]:
        """The tiny model's metrics: `requests_total:<outcome>` for the outcomes, the gauges by name."""
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            match = _METRIC.match(line)
            if match:
                outcome = re.search(r'outcome="(\w+)"', match.group(2))
                values[match.group(1) + (f":{outcome.group(1)}" if outcome else "")] = float(match.group(3))
        return values

    def wait(self, timeout_s: float = 120) -> int:
        """The exit status once it has exited, its stderr read to the end."""
        status = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=timeout_s)
        return status

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.wait()


class BusyCore:
    """Another process keeping one core busy while it is open (a shared CI machine)."""

    def __enter__(self) -> "BusyCore":
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()
