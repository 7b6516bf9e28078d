"""The console scripts' entry points. Each imports its command (about a second: onnxruntime, numpy, click)
with Ctrl-C ending the process by SIGINT and one line, as a Ctrl-C while the command runs does, not with a
traceback from the middle of an import. Nothing here imports more than the standard library."""

from __future__ import annotations

import os
import signal
import sys
from importlib import import_module

from cann_llm.cli.process_end import die_by


def atc() -> None:
    """`atc`."""
    _run("cann_llm.cli.atc")


def cann_run() -> None:
    """`cann-run`."""
    _run("cann_llm.cli.cann_run")


def cann_llm_quant() -> None:
    """`cann-llm-quant`."""
    _run("cann_llm.cli.quant")


def _run(module: str) -> None:
    _standard_streams()
    program = os.path.basename(sys.argv[0])

    def stopped(signum, _frame) -> None:
        os.write(sys.stderr.fileno(), f"\n{program} was stopped by SIGINT\n".encode())
        die_by(signum)

    # a background job's ignored SIGINT stays ignored
    interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if interruptible:
        signal.signal(signal.SIGINT, stopped)
    main = import_module(module).main
    if interruptible:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    main()


def _standard_streams() -> None:
    """/dev/null on a closed stdin, stdout or stderr (`atc ... >&-`): else the next file opened takes its
    descriptor, and what is printed, by Python or by a library's C code, lands in that file (an artifact)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one, those below being open
            setattr(sys, name, open(fd, mode, closefd=False))
