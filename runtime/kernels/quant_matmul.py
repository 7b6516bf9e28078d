"""Reference kernels of the weight-quantized matmuls (docs/ops.md is their specification)."""

from __future__ import annotations

import numpy as np

from passes.quant_math import dequantize_matmul_nbits
from runtime.kernels import register_kernel


@register_kernel("MatMulInt4")
def MatMulInt4(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None, *,
               K: int, N: int, block_size: int, bits: int = 4, accuracy_level: int = 0) -> np.ndarray:
    """a · W with W [K, N] stored in MatMulNBits' layout (b uint8 [N, n_blocks, block_size·bits/8])."""
    del N, bits, accuracy_level  # implied by the operands; accuracy_level is a fast-path choice
    weight = dequantize_matmul_nbits(b, scales.reshape(b.shape[0], -1), zero_points, K, block_size)
    return np.matmul(a.astype(np.float32), weight).astype(a.dtype)


@register_kernel("MatMulInt8")
def MatMulInt8(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None) -> np.ndarray:
    """a · ((b - zero_points) · scales) with b int8/uint8 [K, N] and per-output-channel scales [N]."""
    weight = b.astype(np.float32)
    if zero_points is not None:
        weight -= zero_points.astype(np.float32)
    return np.matmul(a.astype(np.float32), weight * scales.astype(np.float32)).astype(a.dtype)


@register_kernel("GatherInt4")
def GatherInt4(table: np.ndarray, indices: np.ndarray, scales: np.ndarray, *, K: int, block_size: int,
               bits: int = 4) -> np.ndarray:
    """Rows `indices` of a [V, K] table stored as MatMulNBits' B (uint8 [V, n_blocks, block_size·bits/8],
    symmetric): the embedding lookup that shares its bytes with a tied lm_head's MatMulInt4."""
    del bits  # implied by the table's bytes per block
    rows = table[indices.reshape(-1)]
    weight = dequantize_matmul_nbits(rows, scales.reshape(table.shape[0], -1)[indices.reshape(-1)], None, K,
                                     block_size)
    return weight.T.reshape(indices.shape + (K,)).astype(np.float32)


def quantize_per_token(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row of the last axis: (q int8, scale float32 [..., 1]), q · scale ≈ a."""
    scale = np.maximum(np.abs(a).max(axis=-1, keepdims=True) / np.float32(127.0), np.float32(1e-12))
    return np.clip(np.rint(a / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


@register_kernel("MatMulW8A8")
def MatMulW8A8(a: np.ndarray, b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """SmoothQuant's W8A8 matmul: activations quantized to int8 per token at run time, int8 weights b [K, N]
    with per-output-channel scales [N], int32 accumulation: y = (q_a · b) · scale_a · scales."""
    q, scale = quantize_per_token(a.astype(np.float32))
    accumulated = np.matmul(q.astype(np.int32), b.astype(np.int32))
    return (accumulated.astype(np.float32) * scale * scales.astype(np.float32)).astype(a.dtype)
