"""Generated models go to `.cache` in this project's checkout and to the user's cache folder anywhere else:
never into site-packages, nor into the repository of an application that vendors the package."""

from __future__ import annotations

import pytest

from cann_llm.models import tiny

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pyproject, in_checkout", [
    ('[project]\nname = "cann-llm"\nversion = "0.1.0"\n', True),
    ('[project]\nname = "someone-elses-app"\n', False),  # vendored into an application's repository
    (None, False),  # site-packages
])
def test_the_cache_folder_is_the_checkouts_only_in_this_projects_checkout(pyproject, in_checkout, tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    if pyproject is not None:
        (root / "pyproject.toml").write_text(pyproject)
    monkeypatch.setattr(tiny, "REPO_ROOT", root)
    monkeypatch.delenv("CANN_LLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.cache_dir() == (root / ".cache" if in_checkout else tmp_path / "xdg" / "cann-llm")
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path / "chosen"))
    assert tiny.cache_dir() == tmp_path / "chosen"
