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


def layer_shapes(dims: dict) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's pages, from an artifact's `metadata.model`: `layer_kv` lists them
    where the layers differ (Gemma 4's full-attention layers against its sliding ones)."""
    listed = dims.get("layer_kv")
    if listed and len(listed) == dims["num_layers"]:
        return [(int(heads), int(size)) for heads, size in listed]
    return [(dims["num_kv_heads"], dims["head_dim"])] * dims["num_layers"]


class PagePool:
    """`key[layer]` and `value[layer]` are `[num_pages, kv_heads, page_size, head_dim]` arrays, one
    `(kv_heads, head_dim)` of `shapes` a layer: one mapping for all the layers where they are alike (what the
    native attention op reads), one a layer otherwise.

    Which page belongs to which sequence is the block manager's business; the pool only holds the bytes.
    """

    def __init__(self, shapes: list[tuple[int, int]], num_pages: int, page_size: int, dtype=np.float32):
        dtype = np.dtype(dtype)
        self.uniform = len(set(shapes)) <= 1
        if self.uniform:
            heads, size = shapes[0] if shapes else (1, 1)
            shape = (len(shapes), num_pages, heads, page_size, size)
            self.key, self.value = _zeros_mapped(shape, dtype), _zeros_mapped(shape, dtype)
        else:
            self.key = [_zeros_mapped((num_pages, heads, page_size, size), dtype) for heads, size in shapes]
            self.value = [_zeros_mapped((num_pages, heads, page_size, size), dtype) for heads, size in shapes]
        self.num_pages, self.page_size = num_pages, page_size

    @classmethod
    def of(cls, dims: dict, num_pages: int, page_size: int) -> PagePool:
        """The pool for an artifact whose `metadata.model` is `dims`."""
        return cls(layer_shapes(dims), num_pages, page_size)

    def copy(self, copies: list[tuple[int, int, int]]) -> None:
        """Apply the block manager's copies: (source page, target page, leading tokens), every layer."""
        for source, target, tokens in copies:
            for cache in (self.key, self.value):
                if self.uniform:
                    cache[:, target, :, :tokens] = cache[:, source, :, :tokens]
                else:
                    for layer in cache:
                        layer[target, :, :tokens] = layer[source, :, :tokens]

    @property
    def nbytes(self) -> int:
        """Bytes held by the pages of all layers."""
        if self.uniform:
            return self.key.nbytes + self.value.nbytes
        return sum(layer.nbytes for layer in self.key) + sum(layer.nbytes for layer in self.value)

    @staticmethod
    def bytes_per_page(dims: dict, page_size: int, itemsize: int = 4) -> int:
        """What one page costs across all layers, K and V, for an artifact whose `metadata.model` is `dims`."""
        return 2 * page_size * itemsize * sum(heads * size for heads, size in layer_shapes(dims))


def _zeros_mapped(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array on an anonymous mapping (lazily backed, small pages)."""
    size = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
