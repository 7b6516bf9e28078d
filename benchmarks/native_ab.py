"""This checkout's native library (cann_llm/runtime/kernels/native) against another git revision's, for benchmarks
that time a kernel both ways (`--baseline REV`): the revision's library built with this machine's compiler
and `native.build`'s flags, one session per library on the process-wide pool, runs alternating so machine
noise falls on both alike, and their outputs compared."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cann_llm.runtime.kernels import native
from cann_llm.runtime.ort_session import enable_process_thread_pool, session_options

ROOT = Path(__file__).resolve().parents[1]
HERE = "this checkout"


def library_at(revision: str, folder: Path, flags: tuple[str, ...] = ()) -> Path:
    """`revision`'s library, built in `folder` from its copies of the files native.SOURCES names."""
    sources = folder / "src"
    sources.mkdir(parents=True)
    for name in native.SOURCES:
        text = subprocess.run(["git", "show", f"{revision}:cann_llm/runtime/kernels/native/{name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        (sources / name).write_text(text)
    target = folder / "libcann_native.so"
    units = [str(sources / name) for name in native.SOURCES if name.endswith(".c")]
    subprocess.run([native.c_compiler(), *native.FLAGS, *flags, "-I", str(sources), *units, "-o", str(target), "-lm"],
                   check=True, capture_output=True, timeout=300)
    return target


def libraries(baseline: str | None, folder: Path, flags: tuple[str, ...] = ()) -> dict[str, Path]:
    """{name: library}: this checkout's (built into `folder` with `flags` when there are any) and `baseline`'s."""
    found = {HERE: native.build(folder / "here" / "libcann_native.so", native._compiler(), flags)
             if flags else native.library_path()}
    if baseline:
        found[baseline] = library_at(baseline, folder / "baseline", flags)
    return found


def sessions_of(model: bytes, baseline: str | None, threads: int,
                flags: tuple[str, ...] = ()) -> dict[str, ort.InferenceSession]:
    """{name: session of `model`} on this checkout's library (built with `flags` when there are any) and on
    `baseline`'s, all on one process-wide pool of `threads` (two pools would each spin into the other's runs)."""
    enable_process_thread_pool(threads)
    with tempfile.TemporaryDirectory() as scratch:
        sessions = {}
        for name, library in libraries(baseline, Path(scratch), flags).items():
            options = session_options(threads)
            options.register_custom_ops_library(str(library))
            sessions[name] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return sessions  # a loaded library stays mapped once its file is gone


def alternate(sessions: dict[str, ort.InferenceSession], feeds: dict, runs: int) -> tuple[dict, dict]:
    """({name: seconds of each run}, {name: outputs}) over `runs` rounds, each session once a round, after
    three warm-up runs each."""
    outputs = {}
    for name, session in sessions.items():
        for _ in range(3):
            outputs[name] = session.run(None, feeds)
    times = {name: [] for name in sessions}
    for _ in range(runs):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return times, outputs


def comparison(times: dict, outputs: dict) -> str | None:
    """The baseline's median over this checkout's, and the largest difference of their outputs; None
    without a baseline."""
    if len(times) < 2:
        return None
    baseline = next(name for name in times if name != HERE)
    ratio = statistics.median(times[baseline]) / statistics.median(times[HERE])
    largest = max(float(np.abs(a - b).max()) for a, b in zip(outputs[HERE], outputs[baseline]))
    return f"{baseline} / {HERE}: {ratio:.2f}x the time; outputs differ by at most {largest:.2e}"
