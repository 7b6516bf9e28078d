"""Weights copied or laid out at load in memory the kernel maps in huge pages.

The native matmuls read a decode step's weights as many short streams (121 matmul nodes a step on SmolLM2,
each split over the threads), one 4 KB page of the artifact's mapping after another: every page is a TLB
entry of its own, and each stream crosses a page every 64 cache lines. Copied into one anonymous mapping
advised for transparent huge pages, a 2 MB page covers what 512 small ones did: an INT4 decode step on SmolLM2
~1.05x faster (docs/performance.md#weights-in-huge-pages). The artifact's pages of a copied weight are
released once it is copied, so the process holds the weight once, as before; but the copy is the process's
own, where the artifact's pages were the page cache's, shared by every process mapping the file. The float32
panels, laid out at load in any case, are laid out in such a mapping (`empty`).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

ALIGNMENT = 64  # each weight starts on a cache line, as the kernels' loads expect of the artifact's
_SETTINGS = Path("/sys/kernel/mm/transparent_hugepage")


def huge_pages_given(settings: Path = _SETTINGS) -> bool:
    """Whether the kernel gives transparent huge pages to a mapping that asks for them (`[always]` or
    `[madvise]` selected in `enabled`; `[never]`, or no such setting: not Linux, or a kernel without them)."""
    try:
        text = (settings / "enabled").read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def huge_page_size(settings: Path = _SETTINGS) -> int:
    """Bytes of one huge page: the kernel's PMD size (2 MB on x86-64), 2 MB where it does not say."""
    try:
        return int((settings / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class HugePageArena:
    """One anonymous mapping, aligned to a huge page and advised for them, holding arrays of the byte sizes it is
    made for (`sizes`, at most) one after the other. The arrays keep the mapping alive (numpy holds the buffer
    they view). OSError when the system has no room for the mapping."""

    def __init__(self, sizes: list[int]):
        page = huge_page_size()
        size = -(-sum(_padded(nbytes) for nbytes in sizes) // page) * page  # whole huge pages, the last one too
        self._map = mmap.mmap(-1, size + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # refused (a sandbox's filter, say): the arrays stand in small pages, as the artifact's did
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._next = -self._bytes.ctypes.data % page
        self._end = self._next + size

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An array of `shape` and `dtype` in the arena, its values whatever the mapping held (zeros at first)."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self._next + nbytes > self._end:
            raise ValueError(f"the arena has {self._end - self._next} bytes left, not {nbytes}")
        view = self._bytes[self._next:self._next + nbytes].view(dtype).reshape(shape)
        self._next += _padded(nbytes)
        return view

    def copy(self, array: np.ndarray) -> np.ndarray:
        """`array`'s values in the arena, as an array of its dtype and shape."""
        view = self.empty(array.shape, array.dtype)
        view[...] = array
        return view
