"""Running a click command so that coded errors end it cleanly: one message, exit status 1."""

from __future__ import annotations

import sys

import click

from runtime.errors import AtcError

EXIT_FAILURE = 1


def main_with_codes(command: click.Command) -> None:
    """Run `command`; an AtcError prints as `[ERROR] Exxxxx: ...` (never a traceback) and exits 1."""
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
