"""How a command-line tool ends so that a script can read it: by the signal that stopped it, as a shell sees
it (130 for Ctrl-C), and with SIGPIPE's status, 141, once the reader of its stdout has gone, as a C tool
would. atc and cann-run end alike."""

from __future__ import annotations

import os
import select
import signal
import sys


def stdout_gone() -> bool:
    """Whether stdout is a pipe its reader has closed (a broken stderr is not that)."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def reader_gone() -> int:
    """The exit status once whoever read stdout has closed it (`| head -1`, `| grep -q`): what is left to print
    goes to /dev/null (so the interpreter's last flush cannot fail again), and the status is the one a process
    ended by SIGPIPE has, 141."""
    stdout_to_devnull()
    return 128 + signal.SIGPIPE


def stdout_to_devnull() -> None:
    """stdout's descriptor on /dev/null: what is still buffered for it, flushed as the interpreter ends,
    cannot fail a second time."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def die_by(signum: int) -> None:
    """End the process by `signum` with its default action, what was printed flushed first; where the signal
    is blocked, with the status a shell gives it."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)
