"""Reference kernels of the normalisation and activation ops (docs/ops.md is their specification).

They compute in float32 and in the order the unfused exporter graphs do, so they are the executable
spec the onnxruntime lowering is tested against.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import ADD_RMS_NORM, RMS_NORM, SWIGLU


def _rms_normalize(x: np.ndarray, epsilon: float) -> np.ndarray:
    x32 = x.astype(np.float32)
    inverse_rms = np.float32(1.0) / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(epsilon))
    return x32 * inverse_rms


@register_kernel(RMS_NORM)
def RmsNorm(x: np.ndarray, weight: np.ndarray, *, epsilon: float) -> np.ndarray:
    """y = x / sqrt(mean(x², last axis) + epsilon) · weight."""
    return (_rms_normalize(x, epsilon).astype(x.dtype) * weight).astype(x.dtype)


@register_kernel(ADD_RMS_NORM)
def AddRmsNorm(x1: np.ndarray, x2: np.ndarray, weight: np.ndarray, *,
               epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """(RmsNorm(x1 + x2), x1 + x2): the residual sum is an output, for the next residual add."""
    total = x1 + x2
    return RmsNorm(total, weight, epsilon=epsilon), total


@register_kernel(SWIGLU)
def SwiGlu(x: np.ndarray) -> np.ndarray:
    """Last axis split in halves [gate, up]: SiLU(gate) · up."""
    gate, up = np.split(x, 2, axis=-1)
    return (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(x.dtype)
