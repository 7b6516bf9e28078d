"""The configured method (RTN, AWQ, GPTQ, AWQ + GPTQ, SmoothQuant) applied to the weights of MatMuls
that read one input, with that input's calibration statistics; the arithmetic is search.py's and math.py's."""

from __future__ import annotations

import numpy as np

from cann_llm.passes.quant.calibration import InputStatistics
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.search import quantize_weights_together
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight


def weight_block(config: QuantConfig, rows: int) -> int:
    """The block along K: the group size at INT4; INT8 is per output channel, one block of all `rows`."""
    return config.group_size if config.bits == 4 else rows


def quantize_configured(weights: list[np.ndarray], config: QuantConfig,
                        stats: InputStatistics | None) -> tuple[list[QuantizedWeight], np.ndarray | None]:
    """`weights` (all [K, N_i], one shared input) quantized as `config` says, as one [K, ΣN] matrix; returns
    them and the per-channel factor to multiply the input by (AWQ, SmoothQuant), else None."""
    return quantize_weights_together(
        weights, config.method, config.bits, weight_block(config, weights[0].shape[0]), config.symmetric,
        stats and stats.hessian, stats and stats.mean_abs, config.act_order, config.damp, stats and stats.abs_max,
        config.alpha, config.float_zeros)
