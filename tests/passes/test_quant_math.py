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


@pytest.mark.parametrize("symmetric", [True, False])
def test_clipping_lowers_the_output_error_of_heavy_tailed_weights(symmetric):
    from passes.quant_search import CLIP_RATIOS, clip_search, output_error

    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 100)).astype(np.float32) * np.linspace(0.1, 3, 100).astype(np.float32)
    weight = (rng.standard_t(3, (100, 40)) * 0.05).astype(np.float32)  # K = 100: a short last block
    hessian = (x.T @ x).astype(np.float64)
    rtn = output_error(weight, dequantize_blockwise(quantize_blockwise(weight, 4, 32, symmetric)), hessian)
    clipped = clip_search(weight, hessian, 4, 32, symmetric)
    assert output_error(weight, dequantize_blockwise(clipped), hessian) < 0.97 * rtn
    blocks = -(-100 // 32)
    ranges = np.abs(np.concatenate([weight, np.repeat(weight[-1:], blocks * 32 - 100, 0)]).reshape(blocks, 32, 40))
    if symmetric:  # every block's scale is its own range times one of the searched ratios
        ratios = clipped.scales * 7 / ranges.max(axis=1)
        assert np.all(np.min(np.abs(ratios[..., None] - np.asarray(CLIP_RATIOS)), axis=-1) < 1e-5)
