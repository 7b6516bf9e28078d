"""The installed package is one name, `cann_llm`: an application's own `runtime` or `models` package stands
beside it, and `from cann_llm import ...` loads what it names when it is first used, so `atc` does not
load the engine."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cann_llm

pytestmark = pytest.mark.unit

INIT = Path(cann_llm.__file__)


def _run(code: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_stub_type_checkers_read_declares_what_the_package_loads():
    """`__init__.pyi` (each name re-exported `X as X`, as strict type checkers require) and `__init__.py`'s
    own table name the same exports from the same modules, and each resolves to the object it names."""
    stub = ast.parse(INIT.with_name("__init__.pyi").read_text(encoding="utf-8"))
    declared = {alias.asname: (node.module, alias.name) for node in stub.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert all(name == original for name, (_, original) in declared.items())
    assert {name: module for name, (module, _) in declared.items()} == cann_llm._HOMES
    for name, (module, _) in declared.items():
        assert getattr(cann_llm, name) is getattr(importlib.import_module(module), name)
    assert [name for name in dir(cann_llm) if not name.startswith("__")] == sorted(
        name for name in cann_llm.__all__ if not name.startswith("__"))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cann_llm.Nope  # noqa: B018


def test_an_application_with_its_own_runtime_and_models_packages_imports_cann_llm(tmp_path):
    for name in ("runtime", "models", "compiler", "cli", "passes", "apps"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"MINE = {name!r}\n")
    out = _run("import runtime, models, compiler, cli, passes, apps\n"
               "from cann_llm import LLMEngine, compile_model\n"
               "import json; print(json.dumps([runtime.MINE, models.MINE, compiler.MINE, cli.MINE, passes.MINE, "
               "apps.MINE, LLMEngine.__module__, compile_model.__module__]))", tmp_path)
    assert json.loads(out) == ["runtime", "models", "compiler", "cli", "passes", "apps",
                               "cann_llm.runtime.engine.engine", "cann_llm.compiler.compile"]


def test_the_compiler_command_does_not_load_the_engine(tmp_path):
    out = _run("import sys, cann_llm.cli.atc\n"
               "print([m for m in ('cann_llm.runtime.engine.engine', 'cann_llm.runtime.conversation', "
               "'cann_llm.runtime.long_context') if m in sys.modules])", tmp_path)
    assert out.strip() == "[]"

