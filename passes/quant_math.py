"""Weight quantization arithmetic, pure numpy: block-wise along K, symmetric or with zero points.

A weight W [K, N] (MatMul's right operand) is cut into blocks of `block_size` rows; each block of each
column shares one scale (and zero point). The last block may be short: ONNX's blocked DequantizeLinear
and our packing both take ceil(K / block_size) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUPPORTED_BITS = (4, 8)
SUPPORTED_BLOCKS = (32, 64, 128)
EIGHT_BIT_BLOCKS = (128, 64, 32, 16)


def eight_bit_block(rows: int) -> int:
    """The block along K of a blocked 8-bit weight: the largest of 128…16 that divides K, else 128 (K padded)."""
    return next((b for b in EIGHT_BIT_BLOCKS if rows % b == 0), EIGHT_BIT_BLOCKS[0])


@dataclass(frozen=True)
class QuantizedWeight:
    """Integer weights [K, N], scales [n_blocks, N] and zero points [n_blocks, N] (None when symmetric; float
    with `float_zeros`)."""

    values: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block_size: int


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """[K, N] → [n_blocks, block_size, N], the tail padded by repeating the last row (no effect on range)."""
    rows, cols = weight.shape
    n_blocks = -(-rows // block_size)
    pad = n_blocks * block_size - rows
    padded = np.concatenate([weight, np.repeat(weight[-1:], pad, axis=0)]) if pad else weight
    return padded.reshape(n_blocks, block_size, cols)


def quantize_blockwise(weight: np.ndarray, bits: int, block_size: int, symmetric: bool = True,
                       clip: np.ndarray | None = None, float_zeros: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of `weight` [K, N] in blocks of `block_size` rows; `clip` [n_blocks, N]
    (ratios in (0, 1]) shrinks each block's range, saturating its outliers.

    `float_zeros` (asymmetric only): each block spans exactly [min, max] with a float zero point, the
    "scale and minimum" form of GGUF's Q4_1 and HQQ, instead of a range widened to hold 0 and an integer
    zero point; `split_float_zeros` turns it into what the kernels run."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, not {bits}")
    if weight.ndim != 2 or block_size < 1:
        raise ValueError(f"expected a 2-D weight and a positive block size, got {weight.shape}, {block_size}")
    blocks = _blocks(weight.astype(np.float32), block_size)
    ratio = 1.0 if clip is None else np.asarray(clip, np.float32)
    if symmetric:
        q_max = 2 ** (bits - 1) - 1
        scales = np.abs(blocks).max(axis=1) * ratio / q_max
        scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
        values = np.clip(np.rint(blocks / scales[:, None]), -q_max - 1, q_max)
        zero_points = None
    elif float_zeros:
        q_max = 2 ** bits - 1
        low, high = blocks.min(axis=1) * ratio, blocks.max(axis=1) * ratio
        scales = (high - low) / q_max
        scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
        zero_points = (-low / scales).astype(np.float32)
        values = np.clip(np.rint(blocks / scales[:, None] + zero_points[:, None]), 0, q_max)
    else:
        q_max = 2 ** bits - 1
        low, high = np.minimum(blocks.min(axis=1), 0) * ratio, np.maximum(blocks.max(axis=1), 0) * ratio
        scales = (high - low) / q_max
        scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
        zero_points = np.clip(np.rint(-low / scales), 0, q_max)
        values = np.clip(np.rint(blocks / scales[:, None]) + zero_points[:, None], 0, q_max)
    dtype = np.int8 if symmetric else np.uint8
    values = values.reshape(-1, weight.shape[1])[: weight.shape[0]].astype(dtype)
    if zero_points is not None:
        zero_points = zero_points.astype(np.float32 if float_zeros else dtype)
    return QuantizedWeight(values, scales, zero_points, bits, block_size)


def split_float_zeros(quantized: QuantizedWeight) -> tuple[QuantizedWeight, np.ndarray | None]:
    """A weight with float zero points zp as integer zero points z = round(zp) (clipped to the 4-bit range)
    and the remainders [n_blocks, N] z − zp, since scale·(q − zp) = scale·(q − z) + scale·(z − zp):
    MatMulNBits' fast kernels take integer zero points only (a float zero point ran 12-50x slower here),
    so x·W runs as MatMulNBits(x) + (x's sums over each block)·(scale·remainder). Keeping z in the kernel
    leaves the remainder at most half a step (small to store) and the kernel's weight within half a step
    of W, as with integer zero points, where accuracy_level 4 rounds the activations it meets.
    Other weights pass through with None."""
    zero_points = quantized.zero_points
    if zero_points is None or not np.issubdtype(zero_points.dtype, np.floating):
        return quantized, None
    rounded = np.clip(np.rint(zero_points), 0, 2 ** quantized.bits - 1)
    return (QuantizedWeight(quantized.values, quantized.scales, rounded.astype(np.uint8), quantized.bits,
                            quantized.block_size), (rounded - zero_points).astype(np.float32))


def quantize_8bit_blocked(weight: np.ndarray) -> QuantizedWeight:
    """A lm_head's 8-bit quantization (RTN, symmetric, blocks of `eight_bit_block`), the same in atc and the
    QDQ route so that both give the same bytes."""
    return quantize_blockwise(weight, 8, eight_bit_block(weight.shape[0]))


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
