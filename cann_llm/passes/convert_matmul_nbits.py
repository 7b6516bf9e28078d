"""MatMulNBitsConversionPass: com.microsoft.MatMulNBits → cann::MatMulInt4.

MatMulInt4 stores its weight in MatMulNBits' layout by design (docs/ops.md), so an already quantized
model (the onnxruntime-genai builder's `-p int4`, onnxruntime's quantizers) keeps its bytes: the node is
renamed, and a bias (input 5) becomes an Add after it. Taken: 4 or 8 bits, blocks of 16 to 256, constant
weights, scales and uint8 zero points, any accuracy level: 1-3 (float32, float16, bfloat16 activations)
become 0, since onnxruntime's CPU kernel computes them in float32 as it does level 0 (the same outputs,
bit for bit, in tests/passes/test_convert_matmul_nbits.py), and 4 (int8 activations) stays. Float zero
points, g_idx and prepacked GPU layouts stay MatMulNBits, which onnxruntime still runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, fused_node
from cann_llm.passes.rotary_tables import NodeBuilder
from cann_llm.runtime.ops import BLOCK_SIZES

ACCURACY_LEVELS = (0, 1, 2, 3, 4)
INT8_ACTIVATIONS = 4


@dataclass
class MatMulNBitsMatch:
    node: gs.Node
    bias: gs.Tensor | None


def _input(node: gs.Node, index: int) -> gs.Tensor | None:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index].name else None


class ConvertMatMulNBits(FusionPass):
    """Rename onnxruntime's block-quantized matmul into the cann op of the same layout."""

    name = "MatMulNBitsConversionPass"
    anchor = "MatMulNBits"

    def match(self, graph: gs.Graph, node: gs.Node) -> MatMulNBitsMatch | str:
        if node.domain != "com.microsoft":
            return "not com.microsoft's MatMulNBits"
        bits, block = int(node.attrs.get("bits", 4)), int(node.attrs.get("block_size", 0))
        k, n = int(node.attrs.get("K", 0)), int(node.attrs.get("N", 0))
        if bits not in (4, 8):
            return f"{bits}-bit weights (MatMulInt4 takes 4 or 8)"
        if block not in BLOCK_SIZES:
            return f"block_size {block} is not one of {BLOCK_SIZES}"
        if int(node.attrs.get("accuracy_level", 0)) not in ACCURACY_LEVELS:
            return f"accuracy_level {node.attrs.get('accuracy_level')} is not one of {ACCURACY_LEVELS}"
        if int(node.attrs.get("weight_prepacked", 0)):
            return "the weight is prepacked for a GPU"
        if _input(node, 4) is not None:
            return "g_idx is given"
        b, scales, zero_points = node.inputs[1], node.inputs[2], _input(node, 3)
        if not all(isinstance(t, gs.Constant) for t in (b, scales) + ((zero_points,) if zero_points else ())):
            return "the weight, scales or zero points are not constants"
        blocks = -(-k // block)
        if tuple(b.shape) != (n, blocks, block * bits // 8):
            return f"the weight's shape {tuple(b.shape)} is not [N, ceil(K/block), block·bits/8] for K={k}, N={n}"
        if zero_points is not None and np.dtype(zero_points.dtype) != np.uint8:
            return "the zero points are not packed uint8"
        return MatMulNBitsMatch(node, _input(node, 5))

    def rewrite(self, graph: gs.Graph, match: MatMulNBitsMatch) -> None:
        node = match.node
        inputs = [t for t in node.inputs[:4] if t.name]
        y = node.outputs[0]
        attrs = {name: int(node.attrs.get(name, default)) for name, default in
                 (("K", 0), ("N", 0), ("block_size", 0), ("bits", 4))}
        attrs["accuracy_level"] = INT8_ACTIVATIONS if node.attrs.get("accuracy_level", 0) == INT8_ACTIVATIONS else 0
        node.inputs.clear()
        product = y
        if match.bias is not None:
            y.inputs.clear()
            product = gs.Variable(f"{node.name}/product", dtype=y.dtype)
            NodeBuilder(graph, node.name)("Add", [product, match.bias], output=y)
        graph.nodes.append(fused_node("MatMulInt4", inputs, [product], f"{node.name}_MatMulInt4", **attrs))
