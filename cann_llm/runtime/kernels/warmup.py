"""Compile the numba kernels ahead of the first request, and build the native op: `python -m cann_llm.runtime.kernels.warmup`.

numba compiles a kernel at its first call, for that call's argument types, and with `cache=True` stores
the machine code in the user's cache directory (cann_llm/runtime/kernels/numba_cache.py: `$XDG_CACHE_HOME/cann-llm/
numba`, `*.nbi, *.nbc`), where later processes load it in milliseconds. Uncompiled, the first paged step of a
fresh install waits seconds for it. `make install` runs this module once; `warm_up_in_background()` (the
executor calls it when it builds a paged artifact's plan) loads or compiles the same signatures in a thread
while the sessions are being built.

Only compiled, never run: a background thread launching a parallel kernel beside the engine's own would
share numba's thread pool with it.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from cann_llm.runtime.kernels import paged_attention_numba as kernels

_started = threading.Lock()


def _signatures() -> list[tuple[numba.core.registry.CPUDispatcher, tuple]]:
    """(kernel, argument types) for every numba kernel the PagedAttention kernel calls from Python, typed
    from arrays made as a step makes them (PagedBatch's int64 metadata, the pool's 4-D float32 pages)."""
    f32 = np.zeros((2, 2), np.float32)
    rows, pages = numba.typeof(f32), numba.typeof(np.zeros((1, 1, 1, 1), np.float32))
    heads = numba.typeof(np.zeros((1, 1, 1), np.float32))
    ints1, ints2 = numba.typeof(np.zeros(1, np.int64)), numba.typeof(np.zeros((1, 1), np.int64))
    offset, window, scale = numba.typeof(0), numba.typeof(np.int64(0)), numba.typeof(np.float32(0))
    # qsrc, ksrc, kofs, vsrc, vofs, cos, sin, interleaved, slot_mapping
    projections = (rows, rows, offset, rows, offset, rows, rows, offset, ints1)
    rotate = projections + (pages, pages, heads)
    slopes = numba.typeof(np.zeros(0, np.float32))  # and the sinks'
    decode = projections + (ints1, ints2, pages, pages, window, scale, scale, slopes, slopes, heads)  # scale, softcap
    attend = (heads, pages, pages, ints2, ints1, ints1, window, scale, scale, slopes, slopes, heads)
    # in the order a first request needs them: its short prompt, its decode steps, then bigger batches
    return [(kernels._rotate_and_store, rotate), (kernels._attend_serial, attend), (kernels._decode_step, decode),
            (kernels._rotate_and_store_parallel, rotate), (kernels._attend_parallel, attend),
            (kernels._decode_step_parallel, decode)]


def warm_up() -> int:
    """Compile (or load from numba's cache) every signature; returns how many."""
    signatures = _signatures()
    for kernel, types in signatures:
        kernel.compile(types)
    return len(signatures)


def warm_up_in_background() -> None:
    """`warm_up()` in a daemon thread, once per process."""
    if _started.acquire(blocking=False):
        threading.Thread(target=warm_up, name="numba-warmup", daemon=True).start()


if __name__ == "__main__":
    import time

    from cann_llm.runtime.kernels import native

    start = time.perf_counter()
    count = warm_up()
    print(f"numba kernels ready: {count} signatures in {time.perf_counter() - start:.1f} s")
    try:
        library, kernel = native.library_path(), native.matmul_isa()
        ops = "PagedAttention, SwiGlu" + (f", MatMulInt4 ({'AVX-512 VNNI' if kernel == 512 else 'AVX2'})" if kernel else
                                          " (neither AVX-512 VNNI nor AVX2 here: no MatMulInt4)")
        print(f"native ops ready ({ops}): {library}")
    except native.NativeUnavailable as why:
        print(f"native PagedAttention not built ({why}): paged attention runs as host kernels")
