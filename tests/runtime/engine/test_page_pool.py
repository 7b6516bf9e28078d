"""The page pool: one mapping for layers alike, one a layer where their KV sizes differ (Gemma 4)."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.engine.kv_cache import PagePool, layer_shapes

pytestmark = pytest.mark.unit


def test_layers_of_two_sizes_get_pages_of_their_own_sizes_and_copy_alike():
    dims = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "layer_kv": [[2, 16], [1, 32], [2, 16]]}
    pool = PagePool.of(dims, num_pages=4, page_size=16)
    assert not pool.uniform
    assert [cache.shape for cache in pool.key] == [(4, 2, 16, 16), (4, 1, 16, 32), (4, 2, 16, 16)]
    assert PagePool.bytes_per_page(dims, 16) == 2 * 16 * 4 * (32 + 32 + 32)
    assert pool.nbytes == 4 * PagePool.bytes_per_page(dims, 16)
    rng = np.random.default_rng(0)
    for cache in (*pool.key, *pool.value):
        cache[1] = rng.standard_normal(cache.shape[1:])
    pool.copy([(1, 3, 5)])  # a prefix-cache hit on a partly filled page: its first 5 tokens
    for cache in (*pool.key, *pool.value):
        np.testing.assert_array_equal(cache[3, :, :5], cache[1, :, :5])
        assert not cache[3, :, 5:].any()


def test_layers_alike_share_one_mapping_and_sizes_of_another_count_are_not_read():
    dims = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    assert layer_shapes(dims) == [(2, 16), (2, 16)]
    pool = PagePool.of(dims, num_pages=4, page_size=16)
    assert pool.uniform and pool.key.shape == (2, 4, 2, 16, 16)
    # a count the list does not cover (a pipeline sizes its pages by the whole model from one stage)
    assert layer_shapes({**dims, "layer_kv": [[2, 16], [1, 32], [2, 16]]}) == [(2, 16), (2, 16)]
