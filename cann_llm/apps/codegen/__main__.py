"""`python -m cann_llm.apps.codegen generate|optimize|serve --model x.om ...`: code from the command line or over HTTP.
A user's mistake (a model that is missing, not compiled or without a chat template, an unreadable or
empty input, an input too long for the model) is one coded message and a non-zero exit status."""

from __future__ import annotations

import sys

import click

from cann_llm.apps.chat_model import DoesNotFit
from cann_llm.apps.command import HOST, MAX_BODY, max_new_tokens_option, open_chat_model, port_option, serve_on
from cann_llm.runtime.serving.lifecycle import listen
from cann_llm.apps.text_check import unusable
from cann_llm.cli.text_inputs import shown
from cann_llm.cli.coded_errors import main_with_codes
from cann_llm.cli.common_options import CONTEXT_SETTINGS as HELP
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import read_text


@click.group(context_settings=HELP)
def main() -> None:
    """Generate or optimise code with a chat model compiled by atc."""


def _generator(model: str, max_new_tokens: int):
    from cann_llm.apps.codegen.service import SHORTEST, CodeGenerator

    return CodeGenerator(open_chat_model(model, max_new_tokens, SHORTEST), max_new_tokens=max_new_tokens)


_MODEL = click.option("--model", "-m", required=True, help="a chat model's .om (with its tokenizer)")
_TOKENS = max_new_tokens_option(512)
_LANGUAGE = click.option("--language", "-l", default="python", show_default=True)


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@_LANGUAGE
@click.argument("description")
def generate(model: str, max_new_tokens: int, language: str, description: str) -> None:
    """Print code for DESCRIPTION in --language."""
    _check(description, "DESCRIPTION", shown(description))
    _check(language, "--language", shown(language))
    _run(model, max_new_tokens, (shown(description), "DESCRIPTION"),
         lambda generator: generator.generate_code(description, language))


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@_LANGUAGE
@click.argument("source")
def optimize(model: str, max_new_tokens: int, language: str, source: str) -> None:
    """Print a faster, clearer version of the code in SOURCE (a file, or - for stdin)."""
    code = _stdin() if source == "-" else read_text(source)  # before the model loads: a bad file fails at once
    _check(code, "SOURCE", source)
    _check(language, "--language", shown(language))
    _run(model, max_new_tokens, (source, "SOURCE"), lambda generator: generator.optimize_code(code, language))


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@HOST
@port_option(8081)
@MAX_BODY
def serve(model: str, max_new_tokens: int, host: str, port: int, max_body_bytes: int) -> None:
    """Serve POST /generate and POST /optimize."""
    from cann_llm.apps.codegen.app import create_app

    with listen(host, port) as listener:
        generator = _generator(model, max_new_tokens)
        try:
            serve_on(listener, create_app(generator, max_body_bytes), "codegen serving on {url}")
        finally:
            generator.engine.close()


def _stdin() -> str:
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as error:
        raise AtcError("E13001", "-", f"the standard input is not UTF-8 text: {error}") from None


def _check(text: str, name: str, quoted: str) -> None:
    """E10001 for text the service would refuse too (blank, or not UTF-8)."""
    reason = unusable(text)
    if reason is not None:
        raise AtcError("E10001", quoted, name, reason)


def _run(model: str, max_new_tokens: int, given: tuple[str, str], ask) -> None:
    """Print the code `ask(generator)` makes; E10001 naming `given` (the input as shown, its parameter) when
    the input does not fit the model's context."""
    generator = _generator(model, max_new_tokens)
    try:
        result = ask(generator)
    except DoesNotFit as error:
        raise AtcError("E10001", *given, str(error)) from None
    finally:
        generator.engine.close()
    sys.stdout.write(result.code)
    checked = "" if result.valid is None else (" (parses)" if result.valid else f" (does not parse: {result.error})")
    click.echo(f"[INFO] {result.attempts} answer(s){checked}", err=True)


if __name__ == "__main__":
    main_with_codes(main)
