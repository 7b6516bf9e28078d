"""The wheel pip builds for a user: one package, with every file its code reads (a non-editable install
has nothing else)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import cann_llm

ROOT = Path(cann_llm.__file__).resolve().parents[1]


def test_the_wheel_holds_one_package_with_every_file_the_code_reads(tmp_path):
    """Built from a copy of the sources as pip builds it for a user: `cann_llm` alone at the top, and every
    file under it that is not Python (the native op's sources, the default calibration text, the bot's
    knowledge base and page, py.typed, the exports' stub) inside, since a non-editable install has nothing else
    to read; the licence beside them."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "cann_llm", source / "cann_llm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names if not name.startswith("cann_llm-")} == {"cann_llm"}
    shipped = {str(path.relative_to(source)) for path in (source / "cann_llm").rglob("*")
               if path.is_file() and path.suffix != ".py"}
    assert shipped and shipped - names == set()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
