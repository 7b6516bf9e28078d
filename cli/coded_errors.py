"""Running a click command so that coded errors end it cleanly: one message, exit status 1."""

from __future__ import annotations

import logging
import sys
import traceback

import click

from runtime.errors import AtcError

EXIT_FAILURE = 1


def main_with_codes(command: click.Command) -> None:
    """Run `command`; an AtcError prints as `[ERROR] Exxxxx: ...` (never a traceback) and exits 1, and so
    does any other failure, as the internal error E19999 (onnxruntime refusing a shape at run time, say), its
    traceback printed only with debug logging on."""
    try:
        command.main(standalone_mode=False)
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
