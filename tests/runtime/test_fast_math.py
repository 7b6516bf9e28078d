"""fast_exp against its reference, np.exp."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.runtime.kernels.fast_math import fast_exp_array

pytestmark = pytest.mark.unit


def test_fast_exp_matches_numpy_within_its_stated_error():
    x = np.concatenate([np.linspace(-87, 0, 200_001, dtype=np.float32), np.linspace(0, 80, 20_001, dtype=np.float32),
                        np.float32([0.0, -1e-30, -0.5, 1.0])])
    out = np.empty_like(x)
    fast_exp_array(x, out)
    expected = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - expected) / expected) < 5e-7


def test_fast_exp_flushes_below_its_range_instead_of_wrapping():
    x = np.float32([-87.0, -100.0, -1e4, -np.inf])
    out = np.empty_like(x)
    fast_exp_array(x, out)
    assert np.all(out == out[0]) and 0 < out[0] < 2e-38
