"""Weight quantization arithmetic, pure numpy: block-wise along K, symmetric or with zero points.

A weight W [K, N] (MatMul's right operand) is cut into blocks of `block_size` rows; each block of each
column shares one scale (and zero point). The last block may be short: ONNX's blocked DequantizeLinear
and our packing both take ceil(K / block_size) blocks.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight

SUPPORTED_BITS = (4, 8)
SUPPORTED_BLOCKS = (32, 64, 128)
EIGHT_BIT_BLOCKS = (128, 64, 32, 16)


def eight_bit_block(rows: int) -> int:
    """The block along K of a blocked 8-bit weight: the largest of 128…16 that divides K, else 128 (K padded)."""
    return next((b for b in EIGHT_BIT_BLOCKS if rows % b == 0), EIGHT_BIT_BLOCKS[0])


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


def quantize_full_range(weight: np.ndarray, bits: int, block_size: int) -> QuantizedWeight:
    """Symmetric round-to-nearest using all 2^bits levels, as GGUF's Q4_0 does: each block's scale is its
    value of largest magnitude over −2^(bits−1), so that value lands exactly on the lowest level whatever its
    sign (the scale is negative where it is positive), where `quantize_blockwise`'s ±(2^(bits−1) − 1) leaves
    the lowest level to rounding."""
    blocks = _blocks(weight.astype(np.float32), block_size)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    low = -(2 ** (bits - 1))
    scales = np.where(extreme == 0, 1.0, extreme / low).astype(np.float32)
    values = np.clip(np.rint(blocks / scales[:, None]), low, -low - 1)
    values = values.reshape(-1, weight.shape[1])[: weight.shape[0]].astype(np.int8)
    return QuantizedWeight(values, scales, None, bits, block_size)


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
