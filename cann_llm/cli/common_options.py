"""What every click command here shares: `-h`/`--help`, dashes or underscores in long options, `--log-level`."""

from __future__ import annotations

import logging
import os
import sys

import click

from cann_llm.runtime.errors import AtcError

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
DEFAULT_LOG_LEVEL = "warning"


def dashes_for_underscores(token: str) -> str:
    """`max_new_tokens` → `max-new-tokens`: click matches option (and command) names after this, so a long
    option is accepted in either spelling while its help shows the one it was declared with."""
    return token.replace("_", "-")


CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "token_normalize_func": dashes_for_underscores}


class StderrHandler(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a record comes: a command run in-process (a test's
    CliRunner, a script) swaps stderr and closes its copy afterwards, and a handler that kept that copy
    would fail on every later record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr


def configure_logging(level: str) -> None:
    """Log records at `level` and above to stderr, through one handler of ours on the root logger."""
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "cann_llm", False)]
    handler = StderrHandler()
    handler.cann_llm = True
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(LOG_LEVELS[level])


def shows_progress() -> bool:
    """Whether progress and loading lines go to stderr: yes unless `--log-level error` asked for errors only."""
    return logging.getLogger().getEffectiveLevel() < logging.ERROR


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str) -> None:
    configure_logging(value.lower())


_LOG_LEVEL = dict(type=click.Choice(list(LOG_LEVELS), case_sensitive=False), default=DEFAULT_LOG_LEVEL,
                  show_default=True, is_eager=True, expose_value=False, callback=_set_log_level,
                  help="debug, info, warning or error; error also hides progress lines")


def log_level_option(command):
    """Add `--log-level` to `command` (a function being decorated, or a built click command); it configures
    logging before the command runs and is not passed to it."""
    if isinstance(command, click.Command):
        command.params.append(click.Option(["--log-level"], **_LOG_LEVEL))
        return command
    return click.option("--log-level", **_LOG_LEVEL)(command)


class _ExistingFile(click.ParamType):
    """A path to a file that exists: E13001 naming it otherwise (a directory too), as a file that cannot be
    read is everywhere else, where click's own Path check would exit 2 uncoded."""

    name = "file"

    def convert(self, value, param, ctx):
        if not os.path.exists(value):
            raise AtcError("E13001", value, "No such file or directory")
        if os.path.isdir(value):
            raise AtcError("E13001", value, "Is a directory")
        return value


EXISTING_FILE = _ExistingFile()
