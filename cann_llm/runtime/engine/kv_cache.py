"""The page pool: every layer's K and V pages, owned by the runtime rather than the graph.

The pool is sized for the most the engine may ever hold (SmolLM2, 1,024 pages of 128 tokens: 5.9 GB), so
its memory is mapped lazily and a page costs RAM only once written. It is an anonymous mapping rather
than a numpy allocation: numpy asks for transparent huge pages on large arrays, and on a machine whose
memory is fragmented the kernel then compacts memory inside the page fault of the first write to each
2 MB, stalling a prefill for a fraction of a second (docs/performance.md#page-pool).
"""

from __future__ import annotations

import mmap

import numpy as np


class PagePool:
    """`key[layer]` and `value[layer]` are `[num_pages, kv_heads, page_size, head_dim]` arrays.

    Which page belongs to which sequence is the block manager's business; the pool only holds the bytes.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        shape = (num_layers, num_pages, kv_heads, page_size, head_dim)
        self.key = _zeros_mapped(shape, np.dtype(dtype))
        self.value = _zeros_mapped(shape, np.dtype(dtype))
        self.num_pages, self.page_size = num_pages, page_size

    def copy(self, copies: list[tuple[int, int, int]]) -> None:
        """Apply the block manager's copies: (source page, target page, leading tokens), every layer."""
        for source, target, tokens in copies:
            self.key[:, target, :, :tokens] = self.key[:, source, :, :tokens]
            self.value[:, target, :, :tokens] = self.value[:, source, :, :tokens]

    @property
    def nbytes(self) -> int:
        """Bytes held by the pages of all layers."""
        return self.key.nbytes + self.value.nbytes

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        """What one page costs across all layers, K and V."""
        return 2 * num_layers * page_size * kv_heads * head_dim * itemsize


def _zeros_mapped(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array on an anonymous mapping (lazily backed, small pages)."""
    size = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
