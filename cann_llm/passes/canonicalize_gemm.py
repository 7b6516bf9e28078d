"""GemmCanonicalizationPass: a Gemm that multiplies by a weight → MatMul by a [K, N] weight (+ Add of its bias).

Exporters spell a linear layer two ways: TorchScript writes GPT-2's Conv1D layers as `Gemm(x, W, b)`, and the
dynamo exporter writes every linear layer on a 2-D input as `Gemm(x, W, transB=1)` (Qwen2-MoE's shared
expert and routers). The weight passes that follow (QKV, SwiGLU, quantization, 28-bit and panel storage)
read one spelling, `MatMul(x, W[K, N])`; in this one the Gemm's weights are quantized and packed like every
other layer's. Exact: `transB` is applied to the constant, `alpha` folded into it, `beta` into a constant C.
A Gemm whose A is transposed, or whose B is computed, stays. onnxsim writes a biased layer on 3-D tokens as
`Reshape(x, [-1, K])` → Gemm → Reshape: the MatMul reads x itself there, and the head split after it sees the
projection the attention fusion follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.pattern import FusionPass, const_ints, is_graph_output, producer
from cann_llm.passes.shape_values import shape_elements
from cann_llm.passes.weight_memory import Deferred, read_values


@dataclass
class GemmMatch:
    """A Gemm to rewrite, and its bias (C) if it has one."""

    node: gs.Node
    bias: gs.Tensor | None


class CanonicalizeGemm(FusionPass):
    """Rewrite weight Gemms as MatMul (+ Add)."""

    name = "GemmCanonicalizationPass"
    anchor = "Gemm"
    switchable = False

    def __init__(self) -> None:
        self._oriented: dict[tuple[str, bool, float], gs.Constant] = {}
        self._names: set[str] = set()

    def run(self, graph: gs.Graph) -> PassResult:
        self._names = set(graph.tensors())
        try:
            return super().run(graph)
        finally:
            self._oriented.clear()

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
        bias = match.bias
        if bias is not None and float(node.attrs.get("beta", 1.0)) != 1.0:
            bias = self._constant(f"{bias.name}_beta", _scaled(read_values(bias), float(node.attrs["beta"])))
        node.inputs.clear()
        node.outputs.clear()
        per_column = bias is None or isinstance(bias, gs.Constant) and len(bias.shape or ()) <= 1
        tokens = _flattened_tokens(graph, x, output) if per_column else None  # a bias of rows needs the rows
        if tokens is not None:  # the product stays [.., N] rows of the tokens, as the Reshape after it reads
            x, output.shape = tokens, None
        # the Gemm's name goes to its MatMul, so patterns that name the layer (skip_layers) still find it
        name = node.name or f"{output.name}/MatMul"
        if bias is None:
            graph.nodes.append(gs.Node("MatMul", name=name, inputs=[x, weight], outputs=[output]))
            return
        product = gs.Variable(self._unique(f"{output.name}_matmul"), dtype=output.dtype, shape=output.shape)
        graph.nodes.append(gs.Node("MatMul", name=name, inputs=[x, weight], outputs=[product]))
        graph.nodes.append(gs.Node("Add", name=f"{name}/Add", inputs=[product, bias], outputs=[output]))

    def _weight(self, b: gs.Constant, transposed: bool, alpha: float) -> gs.Constant:
        """B as [K, N] times alpha, computed when read (a model's weights are not all held at once); one
        constant for every Gemm that reads the same B the same way. It keeps B's name where nothing else
        reads B (so patterns that name the weight still find it)."""
        if not transposed and alpha == 1.0:
            return b
        key = (b.name, transposed, alpha)
        if key not in self._oriented:
            rows, columns = (int(d) for d in b.shape)
            shape = (columns, rows) if transposed else (rows, columns)

            def oriented() -> np.ndarray:
                values = read_values(b)
                return _scaled(values.T if transposed else values, alpha)

            name = b.name if len(b.outputs) == 1 else f"{b.name}_kn" if alpha == 1.0 else f"{b.name}_kn_x{alpha:g}"
            if name == b.name:
                self._names.discard(name)  # B goes with its one reader
            self._oriented[key] = self._constant(name, Deferred(shape, b.dtype, oriented))
        return self._oriented[key]

    def _constant(self, name: str, values) -> gs.Constant:
        return gs.Constant(self._unique(name), values)

    def _unique(self, name: str) -> str:
        """`name`, or `name` with a number, so that it names no other tensor of the graph."""
        candidate, number = name, 1
        while candidate in self._names:
            candidate, number = f"{name}_{number}", number + 1
        self._names.add(candidate)
        return candidate


def _flattened_tokens(graph: gs.Graph, x: gs.Tensor, output: gs.Tensor) -> gs.Tensor | None:
    """t when the Gemm reads `Reshape(t, [-1, K])` of [.., K] tokens and only a Reshape reads its product
    (onnxsim's spelling of a biased linear layer): the MatMul may read t itself, the Reshape after it sees the
    same elements in the same order (a target holding a 0, which copies an input dim, is left alone)."""
    flatten = producer(x, "Reshape")
    if flatten is None or const_ints(flatten.inputs[1]) is None or len(const_ints(flatten.inputs[1])) != 2:
        return None
    tokens = flatten.inputs[0]
    if tokens.shape is None or len(tokens.shape) < 3 or x.shape is None or tokens.shape[-1] != x.shape[-1] \
            or const_ints(flatten.inputs[1])[0] != -1 or is_graph_output(graph, output) or len(output.outputs) != 1:
        return None
    reader = output.outputs[0]
    if reader.op == "Add" and any(isinstance(t, gs.Constant) and len(t.shape or ()) == 1 for t in reader.inputs) \
            and len(reader.outputs[0].outputs) == 1 and not is_graph_output(graph, reader.outputs[0]):
        reader = reader.outputs[0].outputs[0]
    target = shape_elements(reader.inputs[1]) if reader.op == "Reshape" else None
    if target is None or 0 in target and not reader.attrs.get("allowzero", 0):
        return None
    return tokens


def _scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """`values` × `factor`, computed in float32 at least (half precision would round the factor)."""
    if factor == 1.0:
        return values
    wide = np.promote_types(values.dtype, np.float32)
    return (values.astype(wide) * factor).astype(values.dtype)
