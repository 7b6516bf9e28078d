"""WeightQDQQuantizationPass: MatMul(x, W) → MatMul(x, DequantizeLinear(Wq, scale[, zero_point])).

What `cann-llm-quant --format onnx` writes: a standard ONNX model any onnxruntime runs. INT4 is blocked
along K (opset 21 `block_size`, int4 or uint4 storage); INT8 is per output channel (axis 1). Only 2-D
float constant weights are candidates; `skip` holds fnmatch patterns tested against the MatMul's node
name and its weight's name, and `lm_head` names the MatMul that produces the logits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from passes.base import PassResult
from passes.graph_utils import lm_head, naming_patterns, packed_constant, scale_input
from passes.quant.math import quantize_8bit_blocked
from passes.quant.search import quantize_weights_together
from runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise

QDQ_OPSET = 21
_STORAGE = {(4, True): ml_dtypes.int4, (4, False): ml_dtypes.uint4, (8, True): np.int8, (8, False): np.uint8}


class QuantizeWeightsQDQ:
    """Quantize MatMul weights into DequantizeLinear nodes; `layers` and `matched_patterns` report it."""

    name = "WeightQDQQuantizationPass"
    switchable = True

    def __init__(self, bits: int, block_size: int, symmetric: bool = True, skip: tuple[str, ...] = ("lm_head",),
                 method: str = "rtn", statistics: dict | None = None, act_order: bool = False, damp: float = 0.01,
                 head_bits: int = 8):
        self.bits, self.block_size, self.symmetric, self.skip = bits, block_size, symmetric, skip
        self.head_bits = head_bits
        self.method, self.statistics, self.act_order, self.damp = method, statistics or {}, act_order, damp
        self.layers: list[dict] = []
        self.matched_patterns: set[str] = set()

    def run(self, graph: gs.Graph) -> PassResult:
        result, head = PassResult(), lm_head(graph)
        groups: dict[int, list[gs.Node]] = {}
        for node in [n for n in graph.nodes if n.op == "MatMul"]:
            patterns = naming_patterns(node, node.inputs[1].name, head, self.skip)
            self.matched_patterns.update(patterns)
            pattern = patterns[0] if patterns else None
            weight = node.inputs[1]
            if not isinstance(weight, gs.Constant) or weight.dtype != np.float32 or len(weight.shape) != 2:
                continue
            result.match_times += 1
            if pattern is not None:
                result.rejections.append(f"{node.name}: skipped by pattern {pattern!r}")
                continue
            if node is head and self.bits == 4 and self.head_bits == 8:  # as atc packs it: blocked int8, RTN
                values = np.asarray(weight.values)
                node.inputs[1] = self._dequantize(graph, node, weight, values, quantize_8bit_blocked(values), None,
                                                  blocked=True)
                result.effect_times += 1
                continue
            groups.setdefault(id(node.inputs[0]), []).append(node)
        for nodes in groups.values():
            # MatMuls reading one input are quantized as one matrix, as the QKV and gate/up fusions merge them
            x = nodes[0].inputs[0]
            stats = self.statistics.get(x.name)
            weights = [np.asarray(n.inputs[1].values) for n in nodes]
            block = self.block_size if self.bits == 4 else weights[0].shape[0]
            parts, input_scale = quantize_weights_together(
                weights, self.method, self.bits, block, self.symmetric, stats and stats.hessian,
                stats and stats.mean_abs, self.act_order, self.damp)
            if input_scale is not None:
                scaled = scale_input(graph, x, input_scale, f"{x.name}_awq")
                for node in nodes:
                    node.inputs[0] = scaled
            for node, quantized, values in zip(nodes, parts, weights):
                node.inputs[1] = self._dequantize(graph, node, node.inputs[1], values, quantized, input_scale)
                result.effect_times += 1
            self.statistics.pop(x.name, None)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result

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
