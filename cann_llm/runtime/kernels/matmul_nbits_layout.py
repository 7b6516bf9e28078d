"""onnxruntime's MatMulNBits weight layout and the values it stands for: the runtime's contract for a 4- or
8-bit weight, which the compiler's quantization passes write (cann_llm/passes/quant/math.py) and the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantizedWeight:
    """Integer weights [K, N], scales [n_blocks, N] and zero points [n_blocks, N] (None when symmetric; float
    with `float_zeros`)."""

    values: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block_size: int


def int8_blocks(a: np.ndarray, block_size: int) -> np.ndarray:
    """`a` [..., K] as MatMulNBits' accuracy_level 4 sees it: quantized to int8 symmetrically per row and per
    block of `block_size` channels (scale = max|a| / 127), then dequantized."""
    columns = a.shape[-1]
    padded = np.zeros(a.shape[:-1] + (-(-columns // block_size) * block_size,), np.float32)
    padded[..., :columns] = a
    blocks = padded.reshape(a.shape[:-1] + (-1, block_size))
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = np.where(largest == 0, np.float32(1.0), largest / np.float32(127.0))
    # as onnxruntime's kernel: values times 127 / max|a| (not divided by the scale, which rounds near-ties
    # differently), rounded half to even
    inverse = np.float32(127.0) / np.where(largest == 0, np.float32(1.0), largest)
    return (np.rint(blocks * inverse) * scale).reshape(padded.shape)[..., :columns]


def dequantize_blockwise(quantized: QuantizedWeight) -> np.ndarray:
    """The float weight [K, N] that `quantized` stands for."""
    rows = quantized.values.shape[0]
    scales = np.repeat(quantized.scales, quantized.block_size, axis=0)[:rows]
    values = quantized.values.astype(np.float32)
    if quantized.zero_points is not None:
        values -= np.repeat(quantized.zero_points, quantized.block_size, axis=0)[:rows].astype(np.float32)
    return values * scales


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[..., 2m] values in 0..15 → [..., m] bytes, element 2i in the low nibble (MatMulNBits' order)."""
    values = values.astype(np.uint8)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_matmul_nbits(quantized: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B, scales, zero_points) in onnxruntime's MatMulNBits layout for a 4- or 8-bit `quantized` [K, N].

    B is uint8 [N, n_blocks, block·bits/8]: row n holds output feature n along K, K zero-padded to whole
    blocks, two 4-bit values per byte. Stored values are unsigned: symmetric q is stored as q + 2^(bits-1)
    with the default zero point 2^(bits-1) (zero_points None); asymmetric keeps its unsigned values and
    its zero points [N, ceil(n_blocks·bits/8)], packed like B.
    """
    bits = quantized.bits
    rows, cols = quantized.values.shape
    block = quantized.block_size
    n_blocks = quantized.scales.shape[0]
    stored = quantized.values.astype(np.int16) + (2 ** (bits - 1) if quantized.zero_points is None else 0)
    padded = np.zeros((n_blocks * block, cols), dtype=np.uint8)
    padded[:rows] = stored.astype(np.uint8)
    blob = padded.T.reshape(cols, n_blocks, block)
    blob = _pack_nibbles(blob) if bits == 4 else blob
    scales = np.ascontiguousarray(quantized.scales.T).astype(np.float32)
    zero_points = None
    if quantized.zero_points is not None:
        zp = quantized.zero_points.T.astype(np.uint8)
        if bits == 4 and n_blocks % 2:
            zp = np.concatenate([zp, np.zeros((cols, 1), np.uint8)], axis=1)
        zero_points = np.ascontiguousarray(_pack_nibbles(zp) if bits == 4 else zp)
    return np.ascontiguousarray(blob), scales, zero_points


def unpack_matmul_nbits(blob: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, rows: int,
                        block_size: int) -> QuantizedWeight:
    """The inverse of `pack_matmul_nbits` (symmetric weights come back signed); the bit width is implied by
    B's bytes per block."""
    cols, n_blocks, width = blob.shape
    bits = 8 * width // block_size
    unpack = _unpack_nibbles if bits == 4 else np.asarray
    stored = unpack(blob).reshape(cols, n_blocks * block_size)[:, :rows].T
    if zero_points is None:
        values = (stored.astype(np.int16) - 2 ** (bits - 1)).astype(np.int8)
        return QuantizedWeight(values, scales.T.copy(), None, bits, block_size)
    zp = unpack(zero_points.reshape(cols, -1))[:, :n_blocks].T
    return QuantizedWeight(stored.astype(np.uint8), scales.T.copy(), zp.astype(np.uint8), bits, block_size)


def dequantize_matmul_nbits(blob: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, rows: int,
                            block_size: int) -> np.ndarray:
    """The float weight [K, N] a MatMulNBits operand stands for."""
    return dequantize_blockwise(unpack_matmul_nbits(blob, scales, zero_points, rows, block_size))
