"""The page pool: every layer's K and V pages, owned by the runtime rather than the graph."""

from __future__ import annotations

import numpy as np


class PagePool:
    """`key[layer]` and `value[layer]` are `[num_pages, kv_heads, page_size, head_dim]` arrays.

    Which page belongs to which sequence is the block manager's business; the pool only holds the bytes.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype=np.float32):
        shape = (num_layers, num_pages, kv_heads, page_size, head_dim)
        self.key = np.zeros(shape, dtype=dtype)
        self.value = np.zeros(shape, dtype=dtype)
        self.num_pages, self.page_size = num_pages, page_size

    @property
    def nbytes(self) -> int:
        """Bytes held by the pages of all layers."""
        return self.key.nbytes + self.value.nbytes

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        """What one page costs across all layers, K and V."""
        return 2 * num_layers * page_size * kv_heads * head_dim * itemsize
