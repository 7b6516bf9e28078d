"""MatMulNBits' activation precision per layer: int8 activations (accuracy_level 4, faster) where the
measured output error of quantizing them stays small, float activations (level 0) elsewhere."""

from __future__ import annotations

import numpy as np

from cann_llm.passes.quant.calibration import InputStatistics
from cann_llm.passes.quant.search import int8_activation_error
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise

# relative output error int8 activations may add to a layer before it keeps float activations; well
# above the ~0.5% that rounding to 127 levels costs on ordinary activations, well below outlier layers'
ACCURACY_THRESHOLD = 0.02
# 8-bit MatMulNBits runs with int8 activations: onnxruntime's float-activation 8-bit path is a slow
# fallback here, two orders of magnitude slower than level 4 (docs/performance.md#quantization-choices)
EIGHT_BIT_ACCURACY_LEVEL = 4
# a tied 4-bit lm_head too: quantized before calibration, it has no statistics to choose by; int8
# activations cost SmolLM2's head 0.1 of perplexity, and the native int8 kernel takes only them
# (docs/quantization.md#a-4-bit-lm_head)
TIED_HEAD_ACCURACY_LEVEL = 4


def four_bit_accuracy_level(setting: str, stats: InputStatistics | None, quantized: QuantizedWeight,
                            input_scale: np.ndarray | None) -> int:
    """A 4-bit weight's level: fixed when `setting` is "0" or "4"; for "auto", 4 where int8 activations
    (the calibration `stats` of the MatMul's input, times AWQ's `input_scale`) stay within
    ACCURACY_THRESHOLD of the float output, else 0; 0 without statistics."""
    if setting != "auto" or stats is None:
        return 4 if setting == "4" else 0
    examples = stats.examples * (input_scale if input_scale is not None else 1.0)
    error = int8_activation_error(examples, dequantize_blockwise(quantized), quantized.block_size)
    return 4 if error < ACCURACY_THRESHOLD else 0
