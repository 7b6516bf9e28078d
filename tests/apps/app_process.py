"""An application run as its users run it (`python -m cann_llm.apps.<name> ...`): served on 127.0.0.1 at the port its
startup line names, or run to its end for what it prints and its exit status."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from contextlib import contextmanager

import httpx

HANG_GUARD_S = 600  # only a process that hangs is stopped by it: a crash is reported at once


@contextmanager
def app_process(*argv: str):
    """Run `python -m *argv --port 0`, find the URL its startup line names (the port the system chose),
    check its /health there, yield the URL, stop it."""
    process = subprocess.Popen([sys.executable, "-m", *argv, "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(HANG_GUARD_S, process.kill)
    watchdog.start()
    try:
        said, found = [], None
        for line in process.stderr:  # ends with the process, if it stops before saying where it listens
            said.append(line)
            found = re.search(r"http://127\.0\.0\.1:\d+", line)
            if found:
                break
        assert found, "".join(said)
        url = found.group(0)
        # the socket listens before the line is printed: the request waits for the server, never fails
        assert httpx.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200
        watchdog.cancel()  # it guards the start; a slow test body on a busy machine is not a hang
        yield url
    finally:
        watchdog.cancel()
        process.terminate()
        process.wait(timeout=30)


def run_app(*argv: str) -> subprocess.CompletedProcess:
    """`python -m *argv` run to its end: its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=HANG_GUARD_S)


def assert_refused(done: subprocess.CompletedProcess, *said: str) -> None:
    """The run ended with status 1 (a coded refusal) and a message holding each of `said`, and no traceback."""
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    for text in said:
        assert text in done.stderr, done.stderr
