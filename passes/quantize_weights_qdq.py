"""WeightQDQQuantizationPass: MatMul(x, W) → MatMul(x, DequantizeLinear(Wq, scale[, zero_point])).

What `cann-llm-quant --format onnx` writes: a standard ONNX model any onnxruntime runs. INT4 is blocked
along K (opset 21 `block_size`, int4 or uint4 storage); INT8 is per output channel (axis 1). Only 2-D
float constant weights are candidates; `skip` holds fnmatch patterns tested against the MatMul's node
name and its weight's name, and `lm_head` names the MatMul that produces the logits.
"""

from __future__ import annotations

import fnmatch

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from compiler.pass_manager import PassResult
from passes.graph_utils import packed_constant
from passes.quant_math import dequantize_blockwise, quantize_blockwise

QDQ_OPSET = 21
_PASS_THROUGH = ("Reshape", "Cast", "Identity", "Add")
_STORAGE = {(4, True): ml_dtypes.int4, (4, False): ml_dtypes.uint4, (8, True): np.int8, (8, False): np.uint8}


def lm_head(graph: gs.Graph, output_name: str = "logits") -> gs.Node | None:
    """The MatMul that computes `logits` (through reshapes, casts and a bias add), if any."""
    tensor = next((t for t in graph.outputs if t.name == output_name), None)
    while tensor is not None and tensor.inputs:
        node = tensor.inputs[0]
        if node.op == "MatMul":
            return node
        if node.op not in _PASS_THROUGH:
            return None
        tensor = node.inputs[0]
    return None


class QuantizeWeightsQDQ:
    """Quantize MatMul weights into DequantizeLinear nodes; `layers` and `matched_patterns` report it."""

    name = "WeightQDQQuantizationPass"
    switchable = True

    def __init__(self, bits: int, block_size: int, symmetric: bool = True, skip: tuple[str, ...] = ("lm_head",)):
        self.bits, self.block_size, self.symmetric, self.skip = bits, block_size, symmetric, skip
        self.layers: list[dict] = []
        self.matched_patterns: set[str] = set()

    def _skip_pattern(self, node: gs.Node, head: gs.Node | None) -> str | None:
        for pattern in self.skip:
            if (pattern == "lm_head" and node is head) or any(fnmatch.fnmatchcase(name, pattern)
                                                               for name in (node.name, node.inputs[1].name)):
                return pattern
        return None

    def run(self, graph: gs.Graph) -> PassResult:
        result, head = PassResult(), lm_head(graph)
        for node in [n for n in graph.nodes if n.op == "MatMul"]:
            pattern = self._skip_pattern(node, head)
            if pattern is not None:
                self.matched_patterns.add(pattern)
            weight = node.inputs[1]
            if not isinstance(weight, gs.Constant) or weight.dtype != np.float32 or len(weight.shape) != 2:
                continue
            result.match_times += 1
            if pattern is not None:
                result.rejections.append(f"{node.name}: skipped by pattern {pattern!r}")
                continue
            node.inputs[1] = self._dequantize(graph, node, weight)
            result.effect_times += 1
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        return result

    def _dequantize(self, graph: gs.Graph, node: gs.Node, weight: gs.Constant) -> gs.Variable:
        values = weight.values
        rows = values.shape[0]
        block = self.block_size if self.bits == 4 else rows
        quantized = quantize_blockwise(values, self.bits, block, self.symmetric)
        storage = _STORAGE[(self.bits, self.symmetric)]
        if self.bits == 4:
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
        error = np.abs(dequantize_blockwise(quantized) - values)
        self.layers.append({"node": node.name, "weight": weight.name, "shape": list(values.shape),
                            "max_abs_error": float(error.max()),
                            "relative_error": float(np.linalg.norm(error) / max(np.linalg.norm(values), 1e-12))})
        return output
