"""`python -m apps.codegen generate|optimize|serve --model x.om ...`: code from the command line or over HTTP."""

from __future__ import annotations

import sys

import click

from cli.common_options import CONTEXT_SETTINGS as HELP


@click.group(context_settings=HELP)
def main() -> None:
    """Generate or optimise code with a chat model compiled by atc."""


def _generator(model: str, max_new_tokens: int):
    from apps.codegen.service import CodeGenerator
    from cli.llm_commands import open_engine

    return CodeGenerator(open_engine(model), max_new_tokens=max_new_tokens)


_MODEL = click.option("--model", "-m", required=True, help="a chat model's .om (with its tokenizer)")
_TOKENS = click.option("--max_new_tokens", default=512, show_default=True)
_LANGUAGE = click.option("--language", "-l", default="python", show_default=True)


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@_LANGUAGE
@click.argument("description")
def generate(model: str, max_new_tokens: int, language: str, description: str) -> None:
    """Print code for DESCRIPTION in --language."""
    generator = _generator(model, max_new_tokens)
    try:
        _print(generator.generate_code(description, language))
    finally:
        generator.engine.close()


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@_LANGUAGE
@click.argument("source", type=click.File("r"))
def optimize(model: str, max_new_tokens: int, language: str, source) -> None:
    """Print a faster, clearer version of the code in SOURCE (a file, or - for stdin)."""
    generator = _generator(model, max_new_tokens)
    try:
        _print(generator.optimize_code(source.read(), language))
    finally:
        generator.engine.close()


@main.command(context_settings=HELP)
@_MODEL
@_TOKENS
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8081, show_default=True)
def serve(model: str, max_new_tokens: int, host: str, port: int) -> None:
    """Serve POST /generate and POST /optimize."""
    import uvicorn

    from apps.codegen.app import create_app

    generator = _generator(model, max_new_tokens)
    click.echo(f"codegen serving on http://{host}:{port}", err=True)
    try:
        uvicorn.run(create_app(generator), host=host, port=port, log_level="warning")
    finally:
        generator.engine.close()


def _print(result) -> None:
    sys.stdout.write(result.code)
    checked = "" if result.valid is None else (" (parses)" if result.valid else f" (does not parse: {result.error})")
    click.echo(f"[INFO] {result.attempts} answer(s){checked}", err=True)


if __name__ == "__main__":
    main()
