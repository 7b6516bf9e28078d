"""Standard ops that onnx's reference evaluator cannot run as exporters write them, replaced in the reference
backend (`reference_ops`): the numpy of each beside its OpRun class.

- GatherElements: onnx.reference gathers with `np.choose`, which takes at most 64 choices, so a gather
  along a longer axis fails (Optimum's GPT-J reads its 256-row rotary table with one, GatherElements on
  axis 1); `np.take_along_axis` has no such bound.
- DequantizeLinear: onnx.reference has no implementation for opsets 13-18, where onnxruntime's
  `quantize_dynamic` writes the one after its quantized embedding table's Gather.
"""

from __future__ import annotations

import numpy as np
from onnx import helper
from onnx.reference.op_run import OpRun


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """ONNX GatherElements: negative indices count from the end of `axis`."""
    indices = np.asarray(indices, np.int64)
    return np.take_along_axis(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)


class GatherElements(OpRun):
    op_domain = ""

    def _run(self, data, indices, axis=None):
        return (gather_elements(data, indices, 0 if axis is None else axis),)


def dequantize_linear(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, axis: int = 1,
                      block_size: int = 0) -> np.ndarray:
    """ONNX DequantizeLinear: (x - zero_point) · scale, with one scale (and zero point) for the tensor, one
    for each index of `axis`, or (`block_size`) one for each block of that many along it; in scale's dtype."""
    x = np.asarray(x)
    axis = axis % x.ndim if x.ndim else 0

    def spread(parameter: np.ndarray) -> np.ndarray:
        parameter = np.asarray(parameter).astype(np.float32)
        if parameter.size == 1:
            return parameter.reshape(())
        if block_size:
            return np.repeat(parameter, block_size, axis=axis).take(np.arange(x.shape[axis]), axis=axis)
        shape = [1] * x.ndim
        shape[axis] = -1
        return parameter.reshape(shape)

    values = x.astype(np.float32)
    if zero_point is not None:
        values = values - spread(zero_point)
    return (values * spread(scale)).astype(np.asarray(scale).dtype)


class DequantizeLinear(OpRun):
    op_domain = ""

    def _run(self, x, scale, zero_point=None, axis=None, block_size=None, output_dtype=None):
        y = dequantize_linear(x, scale, zero_point, 1 if axis is None else axis, block_size or 0)
        return (y.astype(helper.tensor_dtype_to_np_dtype(output_dtype)) if output_dtype else y,)


REPLACED: tuple[type[OpRun], ...] = (GatherElements, DequantizeLinear)
