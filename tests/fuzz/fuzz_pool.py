"""Worker processes for fuzz cases: each case runs in a child (fuzz_cases.py), so a segfault shows as a
dead worker ("crash", with its signal) and a case over the time limit as a killed one ("hang"); the
worker is then replaced and the run goes on."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

WORKER = Path(__file__).with_name("fuzz_cases.py")
CASE_TIMEOUT = 120.0  # a hang guard: a case on a busy host can take several times its idle time
START_TIMEOUT = 300.0


class _Worker:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "worker.log"
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, cwd=folder, env=env, text=True)
        self.case: dict | None = None
        self.sent = 0.0
        reply = self._read(START_TIMEOUT)
        if not reply or not reply.get("ready"):
            self.process.kill()
            raise RuntimeError(f"a fuzz worker did not start: {self._tail()}")

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"eof": True}

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-600:]

    def send(self, case: dict) -> None:
        self.case, self.sent = case, time.monotonic()
        self.process.stdin.write(json.dumps({k: case[k] for k in ("kind", "path", "flags") if k in case}) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float) -> dict:
        """The outcome of the case in flight; "hang" (the worker killed) or "crash" (it died) otherwise."""
        reply = self._read(max(0.0, timeout - (time.monotonic() - self.sent)))
        if reply is not None and not reply.get("eof"):
            return reply
        if reply is None:
            self.process.kill()
            self.process.wait()
            return {"outcome": "hang", "seconds": round(time.monotonic() - self.sent, 3)}
        self.process.wait()
        return {"outcome": "crash", "returncode": self.process.returncode, "where": self._tail()[-300:],
                "seconds": round(time.monotonic() - self.sent, 3)}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Pool:
    """`workers` fuzz workers under `folder`; `imap(cases)` runs them, `run(case)` runs one."""

    def __init__(self, folder: Path, workers: int = 1, timeout: float = CASE_TIMEOUT):
        self.folder, self.timeout = Path(folder), timeout
        self._workers = [_Worker(self.folder / f"worker{i}") for i in range(workers)]

    def _replace(self, index: int) -> None:
        self._workers[index] = _Worker(self.folder / f"worker{index}")

    def imap(self, cases: Iterable[dict]) -> Iterator[tuple[dict, dict]]:
        """(case, outcome) pairs, in the order the cases finish; at most one case per worker at a time."""
        pending = iter(cases)
        busy: dict[int, _Worker] = {}
        exhausted = False
        while True:
            for index, worker in enumerate(self._workers):
                if index not in busy and not exhausted:
                    case = next(pending, None)
                    if case is None:
                        exhausted = True
                        break
                    worker.send(case)
                    busy[index] = worker
            if not busy:
                return
            streams = {worker.process.stdout: index for index, worker in busy.items()}
            soonest = min(worker.sent for worker in busy.values()) + self.timeout
            ready, _, _ = select.select(list(streams), [], [], max(0.0, soonest - time.monotonic()))
            finished = [streams[s] for s in ready] or [i for i, w in busy.items() if w.sent + self.timeout <= time.monotonic()]
            for index in finished:
                worker = busy.pop(index)
                outcome = worker.receive(self.timeout)
                if outcome["outcome"] in ("hang", "crash"):
                    self._replace(index)
                yield worker.case, outcome

    def run(self, case: dict) -> dict:
        """The outcome of one case."""
        return next(self.imap([case]))[1]

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
