"""Float32 matmul weights in panels of 16 columns, and the MatMulF32 op that reads them.

Layout (`pack`), for a MatMul's B `[K, N]`: panels of 16 columns (the last one zero-padded), each stored k by
k, 16 floats (64 bytes, one AVX-512 vector) a k: `[ceil(N/16), K, 16]` float32, the same values as B. A
batch-1 decode step reads each panel as one stream, the 16 columns of each k in one load, which its native
kernel (cann_llm/runtime/kernels/native/matmul_panels.c, CPUs with AVX-512) does faster than onnxruntime's MatMul
reads the same bytes (docs/performance.md#fp32-weights-in-panels). The runtime lays an artifact's float32
MatMul weights out so at load where the native library has the op (cann_llm/runtime/executor.py), as onnxruntime
pre-packs them for its own MatMul otherwise; artifacts store them as they are.
"""

from __future__ import annotations

import numpy as np


PANEL = 16  # columns of a panel: one 512-bit vector of float32
MAX_K, MAX_N = 1 << 27, 1 << 31  # the native op's bounds (K as F28's)


def takes(weight: np.ndarray) -> bool:
    """Whether `weight` is a float32 `[K, N]` matrix the op takes."""
    return (weight.dtype == np.float32 and weight.ndim == 2 and 0 not in weight.shape and weight.shape[0] < MAX_K
            and weight.shape[1] < MAX_N)


def shape_of(weight: np.ndarray) -> tuple[int, int, int]:
    """The shape of `weight`'s panels: `[ceil(N/16), K, 16]`."""
    k, n = weight.shape
    return -(-n // PANEL), k, PANEL


def pack(weight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """`weight` (float32 `[K, N]`, any strides: a transpose is read as it lies) as panels `[ceil(N/16), K, 16]`
    (in `out` where given, float32 of `shape_of(weight)`), or None for what the op does not take (`takes`). One
    strided copy into the panels, no temporary (but for a matrix neither row- nor column-major, copied so
    first)."""
    if not takes(weight):
        return None
    k, n = weight.shape
    panels, full = -(-n // PANEL), n // PANEL
    if out is None:
        out = np.empty(shape_of(weight), np.float32)
    elif out.shape != shape_of(weight) or out.dtype != np.float32:
        raise ValueError(f"the panels go in float32 {shape_of(weight)}, not {out.dtype} {out.shape}")
    if weight.strides[1] != weight.itemsize and weight.strides[0] == weight.itemsize:
        # a transposed table [N, K] (a tied head's): panel p is its rows 16p .. 16p + 15, transposed
        table = weight.T
        np.copyto(out[:full], table[:full * PANEL].reshape(full, PANEL, k).transpose(0, 2, 1))
    else:
        weight = weight if weight.strides[1] == weight.itemsize else np.ascontiguousarray(weight)
        np.copyto(out[:full], weight[:, :full * PANEL].reshape(k, full, PANEL).transpose(1, 0, 2))
    if panels > full:
        out[full] = 0
        out[full, :, :n - full * PANEL] = weight[:, full * PANEL:]
    return out


def check(panels: np.ndarray, K: int, N: int) -> None:
    """Raise ValueError unless `panels` holds a weight `[K, N]` in this layout."""
    expected = -(-N // PANEL) * K * PANEL
    if np.size(panels) != expected:
        raise ValueError(f"the panels hold {np.size(panels)} floats, K {K} and N {N} make {expected}")


def unpack(panels: np.ndarray, *, K: int, N: int) -> np.ndarray:
    """The float32 `[K, N]` weight `pack` laid out (ValueError for panels `check` refuses)."""
    check(panels, K, N)
    blocks = np.asarray(panels, np.float32).reshape(-1, K, PANEL)
    return np.ascontiguousarray(blocks.transpose(1, 0, 2).reshape(K, -1)[:, :N])


def MatMulF32(a: np.ndarray, panels: np.ndarray, *, K: int, N: int) -> np.ndarray:
    """a · W with the float32 weight W `[K, N]` in panels (`pack`): the numpy reference of the native op. Not a
    registered kernel: the op is the runtime's own at load, never in an artifact, which the loader refuses."""
    return np.matmul(a.astype(np.float32), unpack(panels, K=K, N=N))
