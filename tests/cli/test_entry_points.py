"""The installed console scripts stopped by Ctrl-C while they import (about a second): one line and the end
a shell reads as Ctrl-C's, never a traceback from inside an import."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = {"atc": "atc", "cann-run": "cann_run", "cann-llm-quant": "cann_llm_quant"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_console_script_enters_through_the_guarded_import(script):
    assert f"from cann_llm.cli.entry import {SCRIPTS[script]}" in Path(sys.executable).with_name(script).read_text()


def test_ctrl_c_while_a_command_imports_ends_it_by_sigint_with_one_line(tmp_path):
    """A command module whose import is interrupted (the signal sent from inside it, so it lands there)."""
    (tmp_path / "slow_command.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)\ndef main():\n    pass\n")
    run = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); sys.argv = ['cann-run']; "
           "from cann_llm.cli.entry import _run; _run('slow_command')")
    stopped = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert stopped.returncode == -signal.SIGINT, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr and stopped.stderr.rstrip().endswith("cann-run was stopped by SIGINT")
