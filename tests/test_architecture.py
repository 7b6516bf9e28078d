"""The layers depend one way, cli → compiler → passes → runtime: read from every module's imports (including
imports inside functions), so a lower layer that reaches up fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("cli", "compiler", "passes", "runtime")


def imported_packages(path: Path) -> set[str]:
    """The first-party top-level packages `path` imports, wherever in the file the import stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS[1:])
def test_no_layer_imports_a_layer_above_it(layer):
    above = set(LAYERS[:LAYERS.index(layer)])
    crossings = sorted(f"{path.relative_to(ROOT)} imports {', '.join(sorted(imported_packages(path) & above))}"
                       for path in (ROOT / layer).rglob("*.py") if imported_packages(path) & above)
    assert crossings == []


def test_the_scan_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from compiler.errors import AtcError\n    import passes.base\n")
    assert imported_packages(module) == {"compiler", "passes"}
