"""`loading(path)`: the lines a command prints on stderr around loading a model, which takes seconds."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import click

from cann_llm.cli.common_options import shows_progress


@contextmanager
def loading(path) -> Iterator[None]:
    """`loading <path> …` before the block and `loaded in N.N s` after it, on stderr (stdout stays the
    command's output); nothing with `--log-level error`."""
    shown = shows_progress()
    if shown:
        click.echo(f"loading {path} …", err=True)
    start = time.perf_counter()
    yield
    if shown:
        click.echo(f"loaded in {time.perf_counter() - start:.1f} s", err=True)
