"""Weights copied at load into memory the kernel maps in 2 MB pages.

The native matmuls read a decode step's weights as many short streams (121 matmul nodes a step on SmolLM2,
each split over the threads), one 4 KB page of the artifact's mapping after another: every page is a TLB
entry of its own, and each stream crosses a page every 64 cache lines. Copied into one anonymous mapping
advised for transparent huge pages, a 2 MB page covers what 512 small ones did: an INT4 decode step on SmolLM2
1.03-1.09x faster (docs/performance.md#weights-in-huge-pages). The artifact's pages of a copied weight are
released once it is copied, so resident memory holds the weight once, as before.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each weight starts on a cache line, as the kernels' loads expect of the artifact's
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available(setting: Path = _SETTING) -> bool:
    """Whether the kernel gives transparent huge pages to a mapping that asks for them (`[always]` or
    `[madvise]` selected; `[never]`, or no such setting: not Linux, or a kernel without them)."""
    try:
        text = setting.read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class HugePageArena:
    """One anonymous mapping, 2 MB aligned and advised for huge pages, holding copies of arrays one after the
    other. The copies keep the mapping alive (numpy holds the buffer it views)."""

    def __init__(self, arrays: list[np.ndarray]):
        size = sum(_padded(a.nbytes) for a in arrays)
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # refused (a sandbox's filter, say): the copies stand in small pages, as the artifact's did
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._next = -self._bytes.ctypes.data % HUGE_PAGE

    def copy(self, array: np.ndarray) -> np.ndarray:
        """`array`'s values in the arena, as an array of its dtype and shape."""
        view = self._bytes[self._next:self._next + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        self._next += _padded(array.nbytes)
        return view
