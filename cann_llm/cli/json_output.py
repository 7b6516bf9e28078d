"""`write_json(path, document)`: a command's machine-read report, to a file or (`-`) to stdout."""

from __future__ import annotations

import json

import click

from cann_llm.runtime.safe_files import write_text


def write_json(path: str, document: dict) -> None:
    """`document` as indented JSON at `path`; `-` writes it to stdout, which the command then keeps for it."""
    text = json.dumps(document, indent=2) + "\n"
    if path == "-":
        click.echo(text, nl=False)
    else:
        write_text(path, text)
