"""Block-wise quantization arithmetic: ranges, round trip within half a step, short last blocks."""

from __future__ import annotations

import numpy as np
import pytest

from passes.quant_math import dequantize_blockwise, quantize_blockwise


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows, block", [(128, 32), (576, 128), (100, 64)])
def test_dequantized_error_is_at_most_half_a_step(bits, symmetric, rows, block):
    weight = np.random.default_rng(rows + bits).standard_normal((rows, 24)).astype(np.float32)
    weight[3, 5] = 9.0  # an outlier widens its block's step, not the others'
    quantized = quantize_blockwise(weight, bits, block, symmetric)
    n_blocks = -(-rows // block)
    assert quantized.values.shape == weight.shape and quantized.scales.shape == (n_blocks, 24)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    assert quantized.values.min() >= low and quantized.values.max() <= high
    step = np.repeat(quantized.scales, block, axis=0)[:rows]
    error = np.abs(dequantize_blockwise(quantized) - weight)
    assert np.all(error <= step / 2 + 1e-6)


def test_zero_blocks_and_bad_arguments():
    quantized = quantize_blockwise(np.zeros((64, 4), np.float32), 4, 32)
    assert np.all(dequantize_blockwise(quantized) == 0)
    with pytest.raises(ValueError):
        quantize_blockwise(np.zeros((64, 4), np.float32), 3, 32)
    with pytest.raises(ValueError):
        quantize_blockwise(np.zeros(64, np.float32), 4, 32)
