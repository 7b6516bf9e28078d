"""Reading memory as fast as a core can, for the bandwidth ceiling of benchmarks/decode_floor.py and
benchmarks/peers.py: `part_reader()` gives a function that reads one array's bytes once.

The read is read_probe.c beside this file, built once per machine, source and compiler with the system's C
compiler (`$CC`, else `cc`) into the user's cache directory; without a compiler, numba's loop over the
floats. The C read is the stronger probe: on a Zen 4 host numba's loop read 42-43 GB/s on two threads in
minutes where the C read reached 58-63 GB/s and the FP32 step's own matmuls 48, so a ceiling from numba's
read let a step's share pass 100% (docs/performance.md#the-bandwidth-ceiling).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import numba
import numpy as np

from runtime.kernels.numba_cache import user_cache_dir
from runtime.made_once import made_once

SOURCE = Path(__file__).with_name("read_probe.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


@numba.njit(nogil=True, fastmath=True)
def _touch(flat):
    total = np.float32(0.0)
    for i in range(flat.size):
        total += flat[i]
    return total


def _build(target: Path, compiler: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as partial:
        pass
    try:
        built = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial.name], capture_output=True, text=True,
                               timeout=120)
        if built.returncode != 0:
            raise RuntimeError(built.stderr.strip()[-400:])
        os.replace(partial.name, target)
    finally:
        if os.path.exists(partial.name):
            os.unlink(partial.name)
    return target


@functools.lru_cache(maxsize=None)
def _c_read() -> Callable[[int, int], float] | None:
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = user_cache_dir("bench") / digest / "read_probe.so"
    try:
        library = ctypes.CDLL(str(made_once(target, lambda: _build(target, compiler), "build.lock")))
    except (OSError, RuntimeError):
        return None
    library.read_bytes.restype = ctypes.c_float
    library.read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return library.read_bytes


def part_reader() -> tuple[str, Callable[[np.ndarray], object]]:
    """The read's name ("C" or "numba") and a function reading a contiguous array's bytes once, releasing the
    GIL so that a thread per core can each read a part; compiled and warmed before it returns."""
    read = _c_read()
    if read is None:
        _touch(np.zeros(16, np.float32))
        return "numba", _touch
    return "C", lambda part: read(part.ctypes.data, part.nbytes)
