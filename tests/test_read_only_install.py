"""Any user, a read-only install: `atc` and `cann-run` start, compile and run as a user who cannot write a
byte of the installed package, nor (a service user's HOME=/nonexistent) a home directory; numba's
machine code goes to the user's cache directory when there is one.

The package tree is copied, made read-only and put first on PYTHONPATH; as root the commands run as
`nobody` (setpriv), since root writes through any mode bits."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NOBODY = 65534


def _as_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no unprivileged user to run as")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _files(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


@pytest.fixture
def sandbox():
    """(read-only package copy, a folder the unprivileged user may write) under /tmp, which it can reach."""
    root = Path(tempfile.mkdtemp(prefix="cann-llm-ro-", dir="/tmp"))
    try:
        site = root / "site"
        shutil.copytree(REPO / "cann_llm", site / "cann_llm", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [site, *site.rglob("*")]:
            path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222 | 0o444 | (0o111 if path.is_dir() else 0))
        work = root / "work"
        work.mkdir()
        work.chmod(0o777)
        root.chmod(0o755)
        yield site, work
    finally:
        for path in [root, *root.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(root)


def _run(site: Path, work: Path, *argv: str, cache: bool = False) -> subprocess.CompletedProcess:
    """`argv` as the unprivileged user, HOME=/nonexistent as `nobody`'s; `cache`: with XDG_CACHE_HOME set."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("NUMBA_", "XDG_"))}
    env.update(PYTHONPATH=str(site), HOME="/nonexistent")
    if cache:
        env["XDG_CACHE_HOME"] = str(work / "cache")
    proc = subprocess.run([*_as_user(), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "no locator available" not in proc.stderr, proc.stderr
    return proc


def _model(path: Path) -> None:
    weight = numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_read_only_install_compiles_runs_and_caches_numba_code_per_user(sandbox):
    site, work = sandbox
    before = _files(site)
    found = _run(site, work, sys.executable, "-c",
                 "import cann_llm.runtime.kernels, cann_llm.cli.atc; print(cann_llm.runtime.kernels.__file__)")
    assert found.stdout.strip().startswith(str(site)), found.stdout  # the read-only copy, not the checkout
    assert "W13004: /nonexistent/.cache/cann-llm/numba cannot be written" in found.stderr  # said, once
    assert found.stderr.count("W13004") == 1, found.stderr
    assert "--mode" in _run(site, work, str(BIN / "atc"), "-h").stdout
    _model(work / "model.onnx")
    _run(site, work, str(BIN / "atc"), "--model=model.onnx", "--framework=5", "--output=model", "--soc_version=Ascend910B")
    assert (work / "model.om").is_file() and (work / "fusion_result.json").is_file()
    np.save(work / "x.npy", np.ones((2, 8), np.float32))
    ran = _run(site, work, str(BIN / "cann-run"), "run", "--model", "model.om", "--input", "x.npy", "--output", "out",
               "--output_dirname", "r")
    assert "NPU_compute_time" in ran.stdout and (work / "out" / "r_summary.json").is_file()
    warmed = _run(site, work, sys.executable, "-m", "cann_llm.runtime.kernels.warmup", cache=True)
    assert "numba kernels ready: 6 signatures" in warmed.stdout and "W13004" not in warmed.stderr
    cached = list((work / "cache" / "cann-llm" / "numba").rglob("*.nbi"))
    assert cached, sorted(_files(work))
    assert _files(site) == before  # not a byte written into the install
