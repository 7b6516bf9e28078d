"""The layers depend one way, cli → compiler → passes → runtime: read from every module's imports (including
imports inside functions), so a lower layer that reaches up fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "cann_llm"
# `cann_llm` itself, the public face, stands above every layer: a layer that imports it reaches up
LAYERS = ("cann_llm", "cli", "compiler", "passes", "runtime")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "cann_llm" and len(parts) > 1 else parts[0]


def imported_packages(path: Path) -> set[str]:
    """The layers `path` imports, wherever in the file the import stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(_layer(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(_layer(node.module))
        elif isinstance(node, ast.ImportFrom):  # relative: the layers are addressed by their full names here
            found.add("relative")
    return found & {*LAYERS, "relative"}


@pytest.mark.parametrize("layer", LAYERS[1:])
def test_no_layer_imports_a_layer_above_it(layer):
    above = {*LAYERS[:LAYERS.index(layer)], "relative"}
    crossings = sorted(f"{path.relative_to(PACKAGE)} imports {', '.join(sorted(imported_packages(path) & above))}"
                       for path in (PACKAGE / layer).rglob("*.py") if imported_packages(path) & above)
    assert crossings == []


def test_the_scan_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from cann_llm.compiler.errors import AtcError\n    import cann_llm.passes.base\n"
                      "    from cann_llm import LLMEngine\n    from . import sibling\n")
    assert imported_packages(module) == {"compiler", "passes", "cann_llm", "relative"}
