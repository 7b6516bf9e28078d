"""Reference kernels of the weight-quantized matmuls (docs/ops.md is their specification)."""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.kernels.matmul_nbits_layout import dequantize_matmul_nbits, int8_blocks
from cann_llm.runtime.ops import GATHER_INT4, MATMUL_INT4, MATMUL_INT8


@register_kernel(MATMUL_INT4)
def MatMulInt4(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None, *,
               K: int, N: int, block_size: int, bits: int, accuracy_level: int) -> np.ndarray:
    """a · W with W [K, N] stored in MatMulNBits' layout (b uint8 [N, n_blocks, block_size·bits/8]); with
    accuracy_level 4, `a` is first rounded to int8 per block of K, as onnxruntime's kernel does."""
    del N, bits  # implied by the operands
    weight = dequantize_matmul_nbits(b, scales.reshape(b.shape[0], -1), zero_points, K, block_size)
    activations = int8_blocks(a.astype(np.float32), block_size) if accuracy_level == 4 else a.astype(np.float32)
    return np.matmul(activations, weight).astype(a.dtype)


@register_kernel(MATMUL_INT8)
def MatMulInt8(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None) -> np.ndarray:
    """a · ((b - zero_points) · scales) with b int8/uint8 [K, N] and per-output-channel scales [N]."""
    weight = b.astype(np.float32)
    if zero_points is not None:
        weight -= zero_points.astype(np.float32)
    return np.matmul(a.astype(np.float32), weight * scales.astype(np.float32)).astype(a.dtype)


@register_kernel(GATHER_INT4)
def GatherInt4(table: np.ndarray, indices: np.ndarray, scales: np.ndarray, *, K: int, block_size: int,
               bits: int) -> np.ndarray:
    """Rows `indices` of a [V, K] table stored as MatMulNBits' B (uint8 [V, n_blocks, block_size·bits/8],
    symmetric): the embedding lookup that shares its bytes with a tied lm_head's MatMulInt4."""
    del bits  # implied by the table's bytes per block
    rows = table[indices.reshape(-1)]
    weight = dequantize_matmul_nbits(rows, scales.reshape(table.shape[0], -1)[indices.reshape(-1)], None, K,
                                     block_size)
    return weight.T.reshape(indices.shape + (K,)).astype(np.float32)
