"""Running a click command so that coded errors end it cleanly: one message, exit status 1."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import click

from runtime.errors import AtcError

EXIT_FAILURE = 1


def reader_gone() -> int:
    """The exit status once whoever read stdout has closed it (`| head -1`, `| grep -q`): what is left to print
    goes to /dev/null (so the interpreter's last flush cannot fail again), and the status is the one a process
    ended by SIGPIPE has, 141, as a C tool's would be."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main_with_codes(command: click.Command) -> None:
    """Run `command`; an AtcError prints as `[ERROR] Exxxxx: ...` (never a traceback) and exits 1, and so
    does any other failure, as the internal error E19999 (onnxruntime refusing a shape at run time, say), its
    traceback printed only with debug logging on."""
    try:
        command.main(standalone_mode=False)
    except BrokenPipeError:
        sys.exit(reader_gone())
    except AtcError as error:
        click.echo(f"[ERROR] {error.render()}", err=True)
        sys.exit(EXIT_FAILURE)
    except click.exceptions.Abort:
        sys.exit(EXIT_FAILURE)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except Exception as error:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            traceback.print_exc()
        click.echo(f"[ERROR] {AtcError('E19999', reason=f'{type(error).__name__}: {error}').render()}", err=True)
        sys.exit(EXIT_FAILURE)
