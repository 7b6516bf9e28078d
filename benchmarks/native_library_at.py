"""The native library (runtime/kernels/native) built from another git revision's sources, with this
machine's compiler and the flags `native.build` uses, for benchmarks that time this checkout's kernels
against that revision's (`--baseline REV`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from runtime.kernels import native

ROOT = Path(__file__).resolve().parents[1]


def library_at(revision: str, folder: Path, flags: tuple[str, ...] = ()) -> Path:
    """`revision`'s library, built in `folder` from its copies of the files native.SOURCES names."""
    sources = folder / "src"
    sources.mkdir(parents=True)
    for name in native.SOURCES:
        text = subprocess.run(["git", "show", f"{revision}:runtime/kernels/native/{name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        (sources / name).write_text(text)
    target = folder / "libcann_native.so"
    units = [str(sources / name) for name in native.SOURCES if name.endswith(".c")]
    subprocess.run([native._compiler(), *native.FLAGS, *flags, "-I", str(sources), *units, "-o", str(target), "-lm"],
                   check=True, capture_output=True, timeout=300)
    return target
