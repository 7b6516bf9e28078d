"""Running a click command so that every way it ends is one a script can read: a failure is one coded message
and exit status 1 (a bad command line too), Ctrl-C one line and death by SIGINT (130 in a shell), a reader
that closed stdout exit status 141, as SIGPIPE ends a C tool."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator

import click
from click.utils import _detect_program_name

from cann_llm.cli.common_options import dashes_for_underscores
from cann_llm.cli.process_end import die_by, reader_gone, stdout_gone
from cann_llm.runtime.errors import AtcError

EXIT_FAILURE = 1


def main_with_codes(command: click.Command) -> None:
    """Run `command` on the process's arguments and exit. An AtcError prints as `[ERROR] Exxxxx: ...` (never a
    traceback) and exits 1; so does a command line click refuses (E10001; E13001 for a file), and any other
    failure, as the internal error E19999 (onnxruntime refusing a shape at run time, say), its traceback
    printed only with debug logging on."""
    args = sys.argv[1:]
    # a background job's ignored SIGINT stays ignored
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        with command.make_context(_detect_program_name(), list(args)) as ctx:  # click consumes the list it is given
            command.invoke(ctx)
        sys.stdout.flush()
    except click.exceptions.Exit as done:  # --help, --version
        sys.exit(done.exit_code)
    except click.exceptions.NoArgsIsHelpError as bare:  # a command group alone: what it offers
        click.echo(bare.ctx.get_help())
        sys.exit(0)
    except KeyboardInterrupt:
        _die_by_sigint(_detect_program_name())
    except Terminated:
        click.echo(f"\n{_detect_program_name()} was stopped by SIGTERM", err=True)
        die_by(signal.SIGTERM)
    except BrokenPipeError as error:
        if stdout_gone():
            sys.exit(reader_gone())
        _fail(AtcError("E19999", reason=f"BrokenPipeError: {error}"))
    except click.UsageError as error:
        _fail(_usage_error(error, args))
    except click.ClickException as error:
        _fail(AtcError("E10001", "the command line", "command line", error.format_message()))
    except AtcError as error:
        _fail(error)
    except Exception as error:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            traceback.print_exc()
        _fail(AtcError("E19999", reason=f"{type(error).__name__}: {error}"))


def _fail(error: AtcError) -> None:
    click.echo(f"[ERROR] {error.render()}", err=True)
    sys.exit(EXIT_FAILURE)


class Terminated(BaseException):
    """SIGTERM, raised where the command is (see `unwind_on_sigterm`)."""


@contextlib.contextmanager
def unwind_on_sigterm() -> Iterator[None]:
    """Within it, SIGTERM (a CI job's timeout, `docker stop`) unwinds a command that writes files as Ctrl-C
    does, so its clean-up runs, and the process then ends by SIGTERM. (`serve` keeps its own SIGTERM: a
    drain.)"""
    def terminated(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one would cut the clean-up short
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    # the first Ctrl-C unwinds, closing the engine (its worker joined, so none is left inside onnxruntime at
    # exit); a second while that waits on a long step ends the process at once, skipping what exit runs
    signal.signal(signal.SIGINT, lambda *_: os._exit(128 + signal.SIGINT))
    raise KeyboardInterrupt


def _die_by_sigint(program: str) -> None:
    """One line, then the end a shell reads as Ctrl-C's (status 130), as atc ends."""
    click.echo(f"\n{program} was stopped by SIGINT", err=True)
    die_by(signal.SIGINT)


def _usage_error(error: click.UsageError, args: list[str]) -> AtcError:
    """click's refusal of the command line as E10001, naming the flag as the user typed it."""
    if isinstance(error, click.NoSuchOption):
        typed = _typed(error.option_name, args) or error.option_name
        command = error.ctx.command if error.ctx else None
        names = [opt for param in getattr(command, "params", []) for opt in getattr(param, "opts", [])]
        close = difflib.get_close_matches(typed.replace("-", "_"), [n.replace("-", "_") for n in names], n=1)
        hint = f" Did you mean '{next(n for n in names if n.replace('-', '_') == close[0])}'?" if close else ""
        return AtcError("E10001", typed, "command line", f"No such option.{hint}")
    if isinstance(error, click.BadParameter) and error.param is not None and error.param.opts:
        flag = error.param.opts[0]
        value = _value_of(error.param.opts, args)
        reason = error.format_message() if isinstance(error, click.MissingParameter) else error.message
        return AtcError("E10001", repr(value) if value is not None else "(none)", flag, reason)
    if error.format_message().startswith("No such command") and args:
        word = next((arg for arg in args if not arg.startswith("-")), args[0])
        return AtcError("E10001", repr(word), "command", error.format_message())
    return AtcError("E10001", repr(" ".join(args)[:80]), "command line", error.format_message())


def _typed(normalized: str, args: list[str]) -> str | None:
    """The word of `args` that click read as option `normalized` (it compares names with dashes)."""
    return next((word.split("=", 1)[0] for word in args
                 if dashes_for_underscores(word.split("=", 1)[0]) == normalized), None)


def _value_of(opts: list[str], args: list[str]) -> str | None:
    """The value given after one of `opts` (`--flag value` or `--flag=value`), the last one given."""
    wanted = {dashes_for_underscores(opt) for opt in opts}
    found = None
    for at, word in enumerate(args):
        name, eq, value = word.partition("=")
        if dashes_for_underscores(name) in wanted:
            found = value if eq else (args[at + 1] if at + 1 < len(args) else None)
    return found
