"""The installed console scripts stopped by Ctrl-C while they import (about a second): one line and the end
a shell reads as Ctrl-C's, never a traceback from inside an import."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _stopped_while_importing(script: str, *argv: str) -> subprocess.CompletedProcess:
    """Run the venv's `script` and send SIGINT once numpy's core library is mapped: by then the entry point
    runs, and the import it does lasts hundreds of milliseconds more (longer on a busy machine)."""
    proc = subprocess.Popen([str(Path(sys.executable).with_name(script)), *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if "_multiarray_umath" in Path(f"/proc/{proc.pid}/maps").read_text():
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


@pytest.mark.parametrize("script", ["atc", "cann-run", "cann-llm-quant"])
def test_ctrl_c_while_a_command_imports_ends_it_by_sigint_with_one_line(script):
    stopped = _stopped_while_importing(script)
    assert stopped.returncode == -signal.SIGINT, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr and stopped.stderr.rstrip().endswith(f"{script} was stopped by SIGINT")
