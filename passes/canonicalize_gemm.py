"""GemmCanonicalizationPass: a Gemm that multiplies by a weight → MatMul by a [K, N] weight (+ Add of its bias).

Exporters spell a linear layer two ways: TorchScript writes GPT-2's Conv1D layers as `Gemm(x, W, b)`, and the
dynamo exporter writes every linear layer on a 2-D input as `Gemm(x, W, transB=1)` (Qwen2-MoE's shared
expert and routers). The weight passes that follow (QKV, SwiGLU, quantization, 28-bit and panel storage)
read one spelling, `MatMul(x, W[K, N])`; in this one the Gemm's weights are quantized and packed like every
other layer's. Exact: `transB` is applied to the constant, `alpha` folded into it, `beta` into a constant C.
A Gemm whose A is transposed, or whose B is computed, stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.pattern import FusionPass


@dataclass
class GemmMatch:
    node: gs.Node
    bias: gs.Tensor | None


class CanonicalizeGemm(FusionPass):
    """Rewrite weight Gemms as MatMul (+ Add)."""

    name = "GemmCanonicalizationPass"
    anchor = "Gemm"
    switchable = False

    def __init__(self) -> None:
        self._oriented: dict[tuple[str, bool, float], gs.Constant] = {}

    def match(self, graph: gs.Graph, node: gs.Node) -> GemmMatch | str:
        if node.attrs.get("transA", 0):
            return "A is transposed"
        if not isinstance(node.inputs[1], gs.Constant):
            return "B is computed, not a weight"
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        if bias is not None and not isinstance(bias, gs.Constant) and float(node.attrs.get("beta", 1.0)) != 1.0:
            return "C is computed and scaled by beta"
        return GemmMatch(node, bias)

    def rewrite(self, graph: gs.Graph, match: GemmMatch) -> None:
        node = match.node
        x, output = node.inputs[0], node.outputs[0]
        weight = self._weight(node.inputs[1], bool(node.attrs.get("transB", 0)), float(node.attrs.get("alpha", 1.0)))
        node.inputs.clear()
        node.outputs.clear()
        name = output.name  # a tensor's name is unique where a node's (often empty) need not be
        if match.bias is None:
            graph.nodes.append(gs.Node("MatMul", name=f"{name}/MatMul", inputs=[x, weight], outputs=[output]))
            return
        product = gs.Variable(f"{output.name}_matmul", dtype=output.dtype, shape=output.shape)
        graph.nodes.append(gs.Node("MatMul", name=f"{name}/MatMul", inputs=[x, weight], outputs=[product]))
        graph.nodes.append(gs.Node("Add", name=f"{name}/Add", outputs=[output],
                                   inputs=[product, _scaled(match.bias, float(node.attrs.get("beta", 1.0)))]))

    def _weight(self, b: gs.Constant, transposed: bool, alpha: float) -> gs.Constant:
        """B as [K, N] times alpha; one constant for every Gemm that reads the same B the same way."""
        if not transposed and alpha == 1.0:
            return b
        key = (b.name, transposed, alpha)
        if key not in self._oriented:
            values = np.asarray(b.values)
            values = values.T if transposed else values
            if alpha != 1.0:
                values = values * values.dtype.type(alpha)
            name = f"{b.name}_kn" if alpha == 1.0 else f"{b.name}_kn_x{alpha:g}"
            self._oriented[key] = gs.Constant(name, np.ascontiguousarray(values))
        return self._oriented[key]


def _scaled(bias: gs.Tensor, beta: float) -> gs.Tensor:
    if beta == 1.0:
        return bias
    values = np.asarray(bias.values)
    return gs.Constant(f"{bias.name}_beta", values * values.dtype.type(beta))
