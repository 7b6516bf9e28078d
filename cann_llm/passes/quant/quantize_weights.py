"""WeightQuantizationPass: constant-weight MatMuls → cann::MatMulInt4 (MatMulNBits layout) or MatMulInt8.

Two sources of quantized weights:
- a float weight, when `--enable_compress_weight` asks for it: quantized here, by round-to-nearest, GPTQ,
  AWQ or SmoothQuant (all but the first from calibration statistics of each MatMul's input over real text;
  the input scaling is folded into the RmsNorm before the MatMul where it alone reads the norm, else a Mul);
- a DequantizeLinear feeding the MatMul (a QDQ model, e.g. from `cann-llm-quant`): its integers are
  repacked as they are, never quantized again, so both routes give the same bytes for the same method.
`match` chooses the weights (weight_selection.py); `rewrite`, the expensive part, quantizes one
(configured_method.py), picks its activation precision (accuracy_level.py) and writes its node
(quantized_matmul.py). A lm_head tied to the embedding table is quantized first, with it (tied_table.py).
Runs after the fusions, so merged QKV and gate/up weights are quantized as the matrices that run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import ContextManager

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import lm_head, tidy
from cann_llm.passes.pattern import FusionPass
from cann_llm.passes.quant.accuracy_level import EIGHT_BIT_ACCURACY_LEVEL, four_bit_accuracy_level
from cann_llm.passes.quant.calibration import InputStatistics, collect_input_statistics
from cann_llm.passes.quant.calibration_windows import within_positions
from cann_llm.passes.quant.config import HESSIAN_METHODS, QuantConfig
from cann_llm.passes.quant.configured_method import quantize_configured
from cann_llm.passes.quant.input_scale import scale_input
from cann_llm.passes.quant.math import quantize_8bit_blocked
from cann_llm.passes.quant.quantized_matmul import QuantizedMatMulWriter, matmul_nbits_form, runs_as_matmul_nbits
from cann_llm.passes.quant.staged_calibration import StagedStatistics
from cann_llm.passes.quant.tied_table import quantize_tied_table
from cann_llm.passes.quant.weight_selection import WeightChoice, calibrated_inputs, choose_weight, lm_head_bits
from cann_llm.passes.weight_memory import read_values
from cann_llm.passes.weight_spill import WeightSpill
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight
from cann_llm.runtime.progress import Progress


class QuantizeWeights(FusionPass):
    """Quantize (or repack) MatMul weights; `progress` shows calibration and quantization on stderr."""

    name = "WeightQuantizationPass"
    anchor = "MatMul"

    def __init__(self, config: QuantConfig | None = None, samples: list[np.ndarray] | None = None,
                 progress: bool = False, spill: WeightSpill | None = None):
        self.config, self.samples, self.progress = config, samples, progress
        self.matched_patterns: set[str] = set()
        self._head: gs.Node | None = None
        self._statistics: dict[str, InputStatistics] | StagedStatistics = {}
        self._readers: Counter[str] = Counter()  # chosen MatMuls still to quantize, by the input they read
        self._writer = QuantizedMatMulWriter(spill)

    def run(self, graph: gs.Graph) -> PassResult:
        """Match every MatMul, then quantize the chosen ones, reporting each as a unit of progress."""
        self._head = lm_head(graph)
        config = self.config
        if config is not None and "lm_head" not in config.skip_layers and self._head is not None:
            quantize_tied_table(graph, self._head, lm_head_bits(config), config.head_group_size,
                                self._writer.spill)
        result = PassResult()
        choices = []
        for node in [n for n in graph.nodes if n.op == self.anchor]:
            if not node.outputs or not any(node in t.inputs for t in node.outputs):
                continue  # the tied lm_head, already replaced
            found = self.match(graph, node)
            if isinstance(found, str):
                result.rejections.append(f"{node.name}: {found}")
            else:
                choices.append(found)
        self._readers = Counter(choice.matmul.inputs[0].name for choice in choices)
        with self._calibration(graph) as self._statistics, \
                Progress("quantization", total=len(choices), unit="weight",
                         enabled=self.progress and bool(choices)) as bar:
            for choice in choices:
                self.rewrite(graph, choice)
                bar.update(status=choice.matmul.name)
        self._statistics = {}
        result.match_times = result.effect_times = len(choices)
        tidy(graph)
        # "lm_head" names the model's head, whichever node that is: a model without one has none to skip
        self.matched_patterns.add("lm_head")
        unmatched = [p for p in config.skip_layers if p not in self.matched_patterns] if config else []
        if unmatched:
            raise AtcError("E10001", ",".join(unmatched), "skip_layers",
                           "The pattern matches no MatMul node or weight of the compiled graph.")
        return result

    def _calibration(self, graph: gs.Graph) -> ContextManager[dict[str, InputStatistics] | StagedStatistics]:
        """The calibration statistics, as a context scoping their progress: for GPTQ and AWQ taken layer by
        layer as the quantizer reaches each, then released; else (SmoothQuant's ranges, or the accuracy
        level's few activation rows) all at once, now."""
        config, samples = self.config, self.samples
        if not samples:
            return contextlib.nullcontext({})
        samples = within_positions(graph, samples, config)
        calibrating = config.needs_calibration
        if calibrating and config.method in HESSIAN_METHODS:
            return StagedStatistics(graph, samples, progress=self.progress)
        statistics = collect_input_statistics(graph, calibrated_inputs(graph, config, self._head),
                                              samples if calibrating else samples[:4], with_hessian=False,
                                              progress=self.progress)
        return contextlib.nullcontext(statistics)

    def match(self, graph: gs.Graph, matmul: gs.Node) -> WeightChoice | str:
        return choose_weight(self.config, matmul, self._head, self.matched_patterns)

    def rewrite(self, graph: gs.Graph, choice: WeightChoice) -> None:
        matmul = choice.matmul
        weight_name, activations = matmul.inputs[1].name, matmul.inputs[0].name
        quantized, input_scale, blocked = self._quantize(choice, activations)
        if input_scale is not None:
            matmul.inputs[0] = scale_input(graph, matmul.inputs[0], input_scale, f"{matmul.name}_awq")
        int8_activations = self.config is not None and self.config.activations == "int8"
        if choice.dynamic_input is not None:
            matmul.inputs[0], int8_activations = choice.dynamic_input, True
        if runs_as_matmul_nbits(quantized, blocked, int8_activations):
            quantized, remainders = matmul_nbits_form(quantized, blocked)
            level = EIGHT_BIT_ACCURACY_LEVEL if quantized.bits == 8 else self._accuracy_level(activations, quantized,
                                                                                               input_scale)
            self._writer.matmul_nbits(graph, matmul, weight_name, quantized, remainders, level)
        else:
            self._writer.matmul_int8(graph, matmul, weight_name, quantized)
        self._readers[activations] -= 1
        if not self._readers[activations]:  # kept until the last MatMul on this input (Gemma's gate and up)
            self._statistics.pop(activations, None)

    def _accuracy_level(self, activations: str, quantized: QuantizedWeight, input_scale: np.ndarray | None) -> int:
        """A 4-bit weight's accuracy level; `activations` names the MatMul's input before any input scaling
        (the calibrated value)."""
        setting = str(self.config.accuracy_level) if self.config else "0"
        stats = self._statistics.get(activations) if setting == "auto" else None
        return four_bit_accuracy_level(setting, stats, quantized, input_scale)

    def _quantize(self, choice: WeightChoice, activations: str) -> tuple[QuantizedWeight, np.ndarray | None, bool]:
        """The weight's integers, the input scale to fold in before it (or None), and whether an 8-bit weight
        is blocked (MatMulNBits' layout) rather than per output channel; `activations` names its input."""
        if choice.qdq is not None:
            return choice.qdq.quantized, None, choice.qdq.blocked
        values = read_values(choice.matmul.inputs[1])
        if choice.head_blocks:
            return quantize_8bit_blocked(values), None, True
        config = self.config
        if choice.matmul is self._head and config.bits == 4:
            config = replace(config, group_size=config.head_group_size)
        (quantized,), input_scale = quantize_configured([values], config, self._statistics.get(activations))
        return quantized, input_scale, False
