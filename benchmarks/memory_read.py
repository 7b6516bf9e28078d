"""Reading memory as fast as a core can, for the bandwidth ceiling of benchmarks/decode_floor.py and
benchmarks/peers.py: `part_reader(streams)` gives a function that reads one array's bytes once, as one linear
stream or as four side by side (STREAMS; the ceiling is the faster of the two, which differs from minute to
minute on one host).

The read is read_probe.c beside this file, built once per machine, source and compiler with the system's C
compiler (`$CC`, else `cc`) into the user's cache directory as the runtime builds its native library; without
a compiler, numba's loop over the floats. The C read is the stronger probe: on a Zen 4 host, in minutes when
it read 52-53 GB/s on two threads, numba's loop read 42-45 and the FP32 step's own matmuls 46, so a ceiling
from numba's read let a step's share pass 100% (docs/performance.md#the-share-of-the-ceiling-beside-each-token).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import numba
import numpy as np

from cann_llm.runtime.kernels import native
from cann_llm.runtime.kernels.numba_cache import user_cache_dir
from cann_llm.runtime.made_once import made_once

SOURCE = Path(__file__).with_name("read_probe.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


@numba.njit(nogil=True, fastmath=True)
def _touch(flat):
    total = np.float32(0.0)
    for i in range(flat.size):
        total += flat[i]
    return total


STREAMS = (1, 4)  # read_probe.c's two forms


@functools.lru_cache(maxsize=None)
def _c_reads() -> dict[int, Callable[[int, int], float]] | None:
    compiler = native.c_compiler()
    if compiler is None:
        return None
    target = user_cache_dir("bench") / native.build_key(compiler, [SOURCE], FLAGS) / "read_probe.so"
    try:
        built = made_once(target, lambda: native.compile_shared(target, [compiler, *FLAGS, str(SOURCE)]), "build.lock")
        library = ctypes.CDLL(str(built))
    except (OSError, native.NativeUnavailable):
        return None
    reads = {1: library.read_one_stream, 4: library.read_four_streams}
    for read in reads.values():
        read.restype = ctypes.c_float
        read.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return reads


def part_reader(streams: int = 1) -> tuple[str, Callable[[np.ndarray], object]]:
    """The read's name ("C" or "numba") and a function reading a contiguous array's bytes once in `streams` (one of
    STREAMS; numba's loop has one form), releasing the GIL so that a thread per core can each read a part;
    compiled and warmed before it returns."""
    reads = _c_reads()
    if reads is None:
        _touch(np.zeros(16, np.float32))
        return "numba", _touch
    read = reads[streams]
    return "C", lambda part: read(part.ctypes.data, part.nbytes)
