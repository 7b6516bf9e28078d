"""Calibration-aware weight quantization, pure numpy: GPTQ and AWQ on top of `quant_math`.

Both see the calibration activations X [n, K] of a MatMul only through H = XᵀX [K, K] (and the mean |x|
per input channel for AWQ): the output error of a weight change Δ [K, N] is ‖XΔ‖² = Σ (HΔ) ⊙ Δ.

GPTQ (Frantar et al., 2022): quantize input rows of W one at a time, spreading each row's rounding error
over the rows not yet quantized through the inverse Hessian. Groups of `block_size` rows share scales
computed when the group is reached (with act_order: from the unupdated weights, the "static groups" form,
so the MatMulNBits block layout holds although rows are visited by decreasing activation energy).

AWQ (Lin et al., 2023): scale input channel k of W by s_k = mean|x_k|^α (the activations by 1/s_k), which
protects the weights that meet large activations; α is searched on a grid by the output error. Then, as
the paper's implementation does, each block of each column is clipped: its range shrunk by the ratio in
{1, 0.95, …, 0.55} that minimises that block's output error (`clip_search`).

AWQ + GPTQ (the JSON form's `"algorithms": [{"name": "awq"}, {"name": "gptq"}]`): AWQ's scaling, then
GPTQ on the scaled weight against the scaled activations' Hessian.
"""

from __future__ import annotations

import numpy as np

from cann_llm.passes.quant.math import quantize_blockwise
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise, int8_blocks


def output_error(weight: np.ndarray, approximation: np.ndarray, hessian: np.ndarray) -> float:
    """‖X·W − X·Ŵ‖² through H = XᵀX."""
    delta = (weight - approximation).astype(np.float64)
    return float(np.sum((hessian @ delta) * delta))


def _group_params(rows: np.ndarray, bits: int, symmetric: bool, float_zeros: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales (and zero points) [N] for one group of rows [g, N], as quantize_blockwise computes them."""
    q = quantize_blockwise(rows, bits, rows.shape[0], symmetric, float_zeros=float_zeros)
    return q.scales[0], None if q.zero_points is None else q.zero_points[0]


def _quantize_row(row: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int) -> np.ndarray:
    if zero is None:
        q_max = 2 ** (bits - 1) - 1
        return np.clip(np.rint(row / scale), -q_max - 1, q_max)
    return np.clip(np.rint(row / scale + zero), 0, 2 ** bits - 1)


def gptq_quantize(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int, symmetric: bool = True,
                  act_order: bool = False, damp: float = 0.01, lazy_batch: int = 128,
                  float_zeros: bool = False) -> QuantizedWeight:
    """GPTQ of `weight` [K, N] given H [K, K]; the result has the layout of quantize_blockwise's."""
    w = weight.astype(np.float64).copy()
    rows, cols = w.shape
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    h[np.diag_indices(rows)] += damp * np.mean(np.diag(h))
    n_blocks = -(-rows // block_size)
    scales = np.zeros((n_blocks, cols), np.float32)
    zeros = None if symmetric else np.zeros((n_blocks, cols), np.float32)
    if act_order:
        for group in range(n_blocks):
            scales[group], zero = _group_params(w[group * block_size:(group + 1) * block_size], bits, symmetric,
                                                float_zeros)
            if zeros is not None:
                zeros[group] = zero
        order = np.argsort(-np.diag(h), kind="stable")
    else:
        order = np.arange(rows)
    w, h = w[order], h[np.ix_(order, order)]
    inverse = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H⁻¹
    values = np.zeros((rows, cols), np.float64)
    for start in range(0, rows, lazy_batch):
        end = min(start + lazy_batch, rows)
        errors = np.zeros((end - start, cols))
        for i in range(start, end):
            original = order[i]
            group = original // block_size
            if not act_order and original % block_size == 0:
                scales[group], zero = _group_params(w[i:i + block_size], bits, symmetric, float_zeros)
                if zeros is not None:
                    zeros[group] = zero
            zero = None if zeros is None else zeros[group]
            q = _quantize_row(w[i], scales[group], zero, bits)
            values[i] = q
            dequantized = (q - (0 if zero is None else zero)) * scales[group]
            error = (w[i] - dequantized) / inverse[i, i]
            w[i:end] -= np.outer(inverse[i, i:end], error)
            errors[i - start] = error
        w[end:] -= inverse[start:end, end:].T @ errors
    restored = np.empty_like(values)
    restored[order] = values
    dtype = np.int8 if symmetric else np.uint8
    if zeros is not None and not float_zeros:
        zeros = zeros.astype(dtype)
    return QuantizedWeight(restored.astype(dtype), scales, zeros, bits, block_size)


CLIP_RATIOS = tuple(1 - step / 20 for step in range(10))


def _block_hessians(hessian: np.ndarray, block_size: int) -> np.ndarray:
    """The diagonal blocks of H [K, K] as [n_blocks, block, block], the tail's padding rows zero."""
    rows = hessian.shape[0]
    n_blocks = -(-rows // block_size)
    padded = np.zeros((n_blocks * block_size,) * 2, np.float64)
    padded[:rows, :rows] = hessian
    index = np.arange(n_blocks)
    return padded.reshape(n_blocks, block_size, n_blocks, block_size)[index, :, index, :]


def clip_search(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int, symmetric: bool = True,
                ratios: tuple[float, ...] = CLIP_RATIOS, float_zeros: bool = False) -> QuantizedWeight:
    """RTN with each block of each column clipped by the ratio minimising that block's output error
    Σ (H_bb Δ_b) ⊙ Δ_b (cross-block terms ignored, as AWQ's clipping does)."""
    rows, cols = weight.shape
    n_blocks = -(-rows // block_size)
    pad = n_blocks * block_size - rows
    blocks = np.concatenate([weight, np.zeros((pad, cols), weight.dtype)]).reshape(n_blocks, block_size, cols)
    hessians = _block_hessians(hessian, block_size)
    best_error, best_ratio = np.full((n_blocks, cols), np.inf), np.ones((n_blocks, cols), np.float32)
    for ratio in ratios:
        clip = np.full((n_blocks, cols), ratio, np.float32)
        restored = dequantize_blockwise(quantize_blockwise(weight, bits, block_size, symmetric, clip, float_zeros))
        delta = blocks - np.concatenate([restored, np.zeros((pad, cols), np.float32)]).reshape(blocks.shape)
        delta = delta.astype(np.float64)
        error = np.sum((hessians @ delta) * delta, axis=1)
        better = error < best_error
        best_error[better], best_ratio[better] = error[better], ratio
    return quantize_blockwise(weight, bits, block_size, symmetric, best_ratio, float_zeros)


def awq_scales(weight: np.ndarray, hessian: np.ndarray, mean_abs: np.ndarray, bits: int, block_size: int,
               symmetric: bool = True, grid: int = 20, float_zeros: bool = False) -> tuple[np.ndarray, float]:
    """(s [K], α) minimising ‖X·W − (X/s)·Q(diag(s)·W)‖² over α ∈ {0, 1/grid, …, 1}, s = mean|x|^α."""
    base = np.maximum(mean_abs.astype(np.float64), 1e-8)
    best = None
    for step in range(grid + 1):
        alpha = step / grid
        scales = base ** alpha
        scales = (scales / np.sqrt(scales.max() * scales.min())).astype(np.float32)
        quantized = quantize_blockwise(weight * scales[:, None], bits, block_size, symmetric, float_zeros=float_zeros)
        error = output_error(weight, dequantize_blockwise(quantized) / scales[:, None], hessian)
        if best is None or error < best[0]:
            best = (error, scales, alpha)
    return best[1], best[2]


def scaled_hessian(hessian: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """H of the activations X / s that diag(s)·W meets: diag(1/s)·H·diag(1/s)."""
    inverse = 1.0 / scales.astype(np.float64)
    return hessian * np.outer(inverse, inverse)


def awq_search(weight: np.ndarray, hessian: np.ndarray, mean_abs: np.ndarray, bits: int, block_size: int,
               symmetric: bool = True, grid: int = 20, float_zeros: bool = False) -> tuple[np.ndarray, QuantizedWeight, float]:
    """AWQ: (s, the clipped quantization of diag(s)·W, α)."""
    scales, alpha = awq_scales(weight, hessian, mean_abs, bits, block_size, symmetric, grid, float_zeros)
    clipped = clip_search(weight * scales[:, None], scaled_hessian(hessian, scales), bits, block_size, symmetric,
                          float_zeros=float_zeros)
    return scales, clipped, alpha


def split_columns(quantized: QuantizedWeight, widths: list[int]) -> list[QuantizedWeight]:
    """Cut a quantized [K, ΣN] weight back into the [K, N_i] weights it was concatenated from."""
    parts, start = [], 0
    for width in widths:
        columns = slice(start, start + width)
        zero_points = None if quantized.zero_points is None else quantized.zero_points[:, columns]
        parts.append(QuantizedWeight(quantized.values[:, columns], quantized.scales[:, columns], zero_points,
                                     quantized.bits, quantized.block_size))
        start += width
    return parts


def quantize_weights_together(weights: list[np.ndarray], method: str, bits: int, block_size: int, symmetric: bool,
                              hessian: np.ndarray | None = None, mean_abs: np.ndarray | None = None,
                              act_order: bool = False, damp: float = 0.01, abs_max: np.ndarray | None = None,
                              alpha: float = 0.5, float_zeros: bool = False) -> tuple[list[QuantizedWeight], np.ndarray | None]:
    """Quantize the weights of MatMuls that read one input as one [K, ΣN] matrix (as a QKV or gate/up fusion
    would merge them), so merged and unmerged graphs get the same integers; returns them and, for AWQ, the
    per-channel factor to multiply the shared input by."""
    merged = np.concatenate(weights, axis=1) if len(weights) > 1 else weights[0]
    input_scale = None
    if method == "smooth_quant":
        scales = smooth_scales(abs_max, merged, alpha)
        quantized = quantize_blockwise(merged * scales[:, None], bits, merged.shape[0], symmetric=True)
        input_scale = (1.0 / scales).astype(np.float32)
    elif method == "gptq":
        quantized = gptq_quantize(merged, hessian, bits, block_size, symmetric, act_order, damp,
                                  float_zeros=float_zeros)
    elif method == "awq":
        scales, quantized, _ = awq_search(merged, hessian, mean_abs, bits, block_size, symmetric,
                                          float_zeros=float_zeros)
        input_scale = (1.0 / scales).astype(np.float32)
    elif method == "awq+gptq":  # AWQ's scaling protects the salient channels, GPTQ then rounds with feedback
        scales, _ = awq_scales(merged, hessian, mean_abs, bits, block_size, symmetric, float_zeros=float_zeros)
        quantized = gptq_quantize(merged * scales[:, None], scaled_hessian(hessian, scales), bits, block_size,
                                  symmetric, act_order, damp, float_zeros=float_zeros)
        input_scale = (1.0 / scales).astype(np.float32)
    else:
        quantized = quantize_blockwise(merged, bits, block_size, symmetric, float_zeros=float_zeros)
    return split_columns(quantized, [w.shape[1] for w in weights]), input_scale


def int8_activation_error(examples: np.ndarray, weight: np.ndarray, block_size: int) -> float:
    """Relative output error ‖(X − X̂)·W‖ / ‖X·W‖ when the activations X are quantized to int8 symmetrically
    per row and per block of `block_size` input channels, as MatMulNBits' accuracy_level 4 does."""
    exact = examples @ weight
    error = (examples - int8_blocks(examples, block_size)) @ weight
    return float(np.linalg.norm(error) / max(np.linalg.norm(exact), 1e-12))


def smooth_scales(abs_max: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant (Xiao et al., 2023): s_k = max|x_k|^α / max|W_k|^(1−α); activations are divided by s and
    weight rows multiplied by it, moving the activation outliers' range into the weights."""
    weight_max = np.maximum(np.abs(weight).max(axis=1), 1e-5)
    return (np.maximum(abs_max, 1e-5) ** alpha / weight_max ** (1.0 - alpha)).astype(np.float32)
