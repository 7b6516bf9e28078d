"""WeightQDQQuantizationPass: MatMul(x, W) → MatMul(x, DequantizeLinear(Wq, scale[, zero_point])).

What `cann-llm-quant --format onnx` writes: a standard ONNX model any onnxruntime runs. INT4 is blocked
along K (opset 21 `block_size`, int4 or uint4 storage); INT8 is per output channel (axis 1). Only 2-D
float constant weights are candidates; the config's `skip_layers` are fnmatch patterns tested against the
MatMul's node name and its weight's name, and `lm_head` names the MatMul that produces the logits.
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import lm_head, packed_constant, tidy
from cann_llm.passes.quant.calibration import InputStatistics
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.configured_method import quantize_configured
from cann_llm.passes.quant.input_scale import scale_input
from cann_llm.passes.quant.math import quantize_8bit_blocked
from cann_llm.passes.quant.staged_calibration import StagedStatistics
from cann_llm.passes.quant.weight_selection import float_weight, lm_head_bits, routes_experts, skip_patterns
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise
from cann_llm.runtime.progress import Progress

QDQ_OPSET = 21
_STORAGE = {(4, True): ml_dtypes.int4, (4, False): ml_dtypes.uint4, (8, True): np.int8, (8, False): np.uint8}


class QuantizeWeightsQDQ:
    """Quantize MatMul weights into DequantizeLinear nodes as `config` says, from the calibration
    `statistics` of the MatMuls' inputs when the method needs them; `layers` and `matched_patterns` report
    it, `progress` shows it on stderr."""

    name = "WeightQDQQuantizationPass"
    switchable = True

    def __init__(self, config: QuantConfig, statistics: dict[str, InputStatistics] | StagedStatistics | None = None,
                 progress: bool = False):
        self.config, self.statistics, self.progress = config, statistics or {}, progress
        self.layers: list[dict] = []
        self.matched_patterns: set[str] = set()

    def run(self, graph: gs.Graph) -> PassResult:
        result, head, config = PassResult(), lm_head(graph), self.config
        groups: dict[int, list[gs.Node]] = {}
        for node in [n for n in graph.nodes if n.op == "MatMul"]:
            patterns = skip_patterns(config, node, head)
            self.matched_patterns.update(patterns)
            weight = node.inputs[1]
            if not float_weight(weight):
                continue
            result.match_times += 1
            if patterns:
                result.rejections.append(f"{node.name}: skipped by pattern {patterns[0]!r}")
                continue
            if routes_experts(node, head):
                result.rejections.append(f"{node.name}: an MoE's routing weight: it stays float")
                continue
            if node is head and config.bits == 4 and lm_head_bits(config) == 8:  # as atc packs it: blocked int8, RTN
                values = np.asarray(weight.values)
                node.inputs[1] = self._dequantize(graph, node, weight, values, quantize_8bit_blocked(values), None,
                                                  blocked=True)
                result.effect_times += 1
                continue
            groups.setdefault(id(node.inputs[0]), []).append(node)
        with Progress("quantization", total=sum(map(len, groups.values())), unit="weight",
                      enabled=self.progress and bool(groups)) as bar:
            for nodes in groups.values():
                # a 4-bit lm_head (alone on its input) in its own group size
                own = nodes == [head] and config.bits == 4
                self._quantize_group(graph, nodes, replace(config, group_size=config.head_group_size) if own else config)
                result.effect_times += len(nodes)
                bar.update(len(nodes), status=nodes[0].name)
        tidy(graph)
        return result

    def _quantize_group(self, graph: gs.Graph, nodes: list[gs.Node], config: QuantConfig) -> None:
        """MatMuls reading one input are quantized as one matrix, as the QKV and gate/up fusions merge them."""
        x = nodes[0].inputs[0]
        weights = [np.asarray(n.inputs[1].values) for n in nodes]
        parts, input_scale = quantize_configured(weights, config, self.statistics.get(x.name))
        if input_scale is not None:
            scaled = scale_input(graph, x, input_scale, f"{x.name}_awq")
            for node in nodes:
                node.inputs[0] = scaled
        for node, quantized, values in zip(nodes, parts, weights):
            node.inputs[1] = self._dequantize(graph, node, node.inputs[1], values, quantized, input_scale)
        self.statistics.pop(x.name, None)

    def _dequantize(self, graph: gs.Graph, node: gs.Node, weight: gs.Constant, values: np.ndarray,
                    quantized: QuantizedWeight, input_scale: np.ndarray | None, blocked: bool = False) -> gs.Variable:
        block = quantized.block_size
        storage = _STORAGE[(quantized.bits, quantized.zero_points is None)]
        if quantized.bits == 4 or blocked:
            scales, zero_points, attrs = quantized.scales, quantized.zero_points, {"axis": 0, "block_size": block}
        else:
            scales = quantized.scales[0]
            zero_points = None if quantized.zero_points is None else quantized.zero_points[0]
            attrs = {"axis": 1}
        inputs = [packed_constant(f"{weight.name}_quantized", quantized.values.astype(storage)),
                  gs.Constant(f"{weight.name}_scale", scales)]
        if zero_points is not None:
            inputs.append(packed_constant(f"{weight.name}_zero_point", zero_points.astype(storage)))
        output = gs.Variable(f"{weight.name}_dequantized", dtype=np.float32, shape=list(values.shape))
        graph.nodes.append(gs.Node("DequantizeLinear", name=f"{node.name}_DequantizeLinear", attrs=attrs,
                                   inputs=inputs, outputs=[output]))
        effective = dequantize_blockwise(quantized)
        if input_scale is not None:
            effective = effective * input_scale[:, None]
        error = np.abs(effective - values)
        self.layers.append({"node": node.name, "weight": weight.name, "shape": list(values.shape),
                            "max_abs_error": float(error.max()),
                            "relative_error": float(np.linalg.norm(error) / max(np.linalg.norm(values), 1e-12))})
        return output
