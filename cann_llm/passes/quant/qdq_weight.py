"""Reading a QDQ model's weights: the integers behind a DequantizeLinear that feeds a MatMul, as they are.

A QDQ model (e.g. from `cann-llm-quant`) is repacked, never quantized again, so both routes give the same
bytes for the same method: blocked along K (INT4, or an 8-bit lm_head packed as atc packs it), or 8-bit
per output channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import producer
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight

BLOCK_SIZES = (16, 32, 64, 128, 256)
_BITS = {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8}


@dataclass(frozen=True)
class QdqWeight:
    """The integers of a DequantizeLinear weight; `blocked`: an 8-bit weight blocked along K (MatMulNBits'
    layout), not per output channel."""

    quantized: QuantizedWeight
    blocked: bool


def read_qdq_weight(weight: gs.Tensor) -> QdqWeight | str | None:
    """The integers behind a DequantizeLinear weight; None if the weight is not one; a reason if unusable."""
    dequantize = producer(weight, "DequantizeLinear")
    if dequantize is None:
        return None
    values, scales = dequantize.inputs[0], dequantize.inputs[1]
    zero_points = dequantize.inputs[2] if len(dequantize.inputs) > 2 and dequantize.inputs[2].name else None
    if not all(isinstance(t, gs.Constant) for t in [values, scales] + ([zero_points] if zero_points else [])):
        return "the DequantizeLinear inputs are not constants"
    q = np.asarray(values.values)
    if q.ndim != 2:
        return "the quantized weight is not 2-D"
    kind = np.dtype(q.dtype).name
    block, axis = dequantize.attrs.get("block_size", 0), dequantize.attrs.get("axis", 1)
    zp = None if zero_points is None else np.asarray(zero_points.values)
    bits = _BITS.get(kind)
    if bits and axis == 0 and block in BLOCK_SIZES:
        return QdqWeight(_blocked(q, np.asarray(scales.values, np.float32), zp, kind, bits, block), blocked=bits == 8)
    if kind in ("int8", "uint8") and axis in (1, -1) and not block and np.asarray(scales.values).size == q.shape[1]:
        # one block of all K rows: the storage conventions are the blocked form's
        scale = np.asarray(scales.values, np.float32).reshape(1, -1)
        return QdqWeight(_blocked(q, scale, None if zp is None else zp.reshape(1, -1), kind, 8, q.shape[0]),
                         blocked=False)
    return f"unsupported DequantizeLinear ({kind}, axis {axis}, block {block})"


def _blocked(q: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, kind: str, bits: int,
             block: int) -> QuantizedWeight:
    """A blocked DequantizeLinear's integers in MatMulNBits' terms: signed storage with nonzero zero points
    moves to unsigned (offset by half the range), as the kernel takes unsigned zero points only; unsigned
    storage always has zero points (0 where the DequantizeLinear gives none), since a weight without them is
    read as signed."""
    offset = 2 ** (bits - 1)
    if kind.startswith("int") and zp is not None and np.any(zp.astype(np.int16) != 0):
        return QuantizedWeight((q.astype(np.int16) + offset).astype(np.uint8), scales,
                               (zp.astype(np.int16) + offset).astype(np.uint8), bits, block)
    # as they lie where they are bytes already (a view of the mapped file, not a copy each)
    if kind.startswith("int"):
        return QuantizedWeight(np.asarray(q, np.int8), scales, None, bits, block)
    zero = zp if zp is not None else np.zeros_like(scales, np.uint8)
    return QuantizedWeight(np.asarray(q, np.uint8), scales, zero.astype(np.uint8), bits, block)
