"""The public Python face of the project: `from cann_llm import ...` (compile, run, generate).

Each name is imported on first use: every command lives under this package (`cann_llm.cli`), and `atc`
should not pay for the engine, nor `cann-run` for the compiler. The names and their modules are the
imports of `__init__.pyi`, which type checkers read."""

from __future__ import annotations

import ast
from importlib import import_module
from pathlib import Path


def _homes() -> dict[str, str]:
    """{exported name: its module}, from the stub's `from module import name as name` lines."""
    stub = ast.parse(Path(__file__).with_name("__init__.pyi").read_text(encoding="utf-8"))
    return {alias.asname or alias.name: node.module for node in stub.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


_HOMES = _homes()
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cann_llm' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
