"""The installed package is one name, `cann_llm`: an application's own `runtime` or `models` package stands
beside it, and `from cann_llm import ...` loads what it names when it is first used, so `atc` does not
load the engine."""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cann_llm

pytestmark = pytest.mark.unit

INIT = Path(cann_llm.__file__)


def _run(code: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_export_the_stub_declares_resolves_to_the_object_it_names():
    """`__init__.pyi` is what type checkers read and what the package loads from; each name re-exported
    (`X as X`, as strict type checkers require) and found where the stub says."""
    stub = ast.parse(INIT.with_name("__init__.pyi").read_text(encoding="utf-8"))
    declared = {alias.asname: (node.module, alias.name) for node in stub.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert sorted(declared) == cann_llm.__all__ and len(declared) >= 20
    for name, (module, original) in declared.items():
        assert name == original
        assert getattr(cann_llm, name) is getattr(importlib.import_module(module), name)
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


def test_the_wheel_holds_one_package_with_every_file_the_code_reads(tmp_path):
    """Built from a copy of the sources as pip builds it for a user: `cann_llm` alone at the top, and every
    file under it that is not Python (the native op's sources, the default calibration text, the bot's
    knowledge base and page, py.typed) inside, since a non-editable install has nothing else to read."""
    root = INIT.parents[1]
    source = tmp_path / "source"
    shutil.copytree(root / "cann_llm", source / "cann_llm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names if not name.startswith("cann_llm-")} == {"cann_llm"}
    shipped = {str(path.relative_to(source)) for path in (source / "cann_llm").rglob("*")
               if path.is_file() and path.suffix != ".py"}
    assert shipped and shipped - names == set()
