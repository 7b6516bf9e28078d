"""SwiGluFusionPass: SiLU(x·Wg) · (x·Wu) → cann::SwiGlu(x·[Wg | Wu]), one MatMul for both projections.

Anchored at the Sigmoid of SiLU = g · sigmoid(g). The gate and up halves come either from two MatMuls (a
Gemm is one by now: cann_llm/passes/canonicalize_gemm.py) of the same input with constant weights, each optionally
plus a constant bias (a Llama with `mlp_bias`), merged here into one [K, 2I] weight (one GEMM instead of two;
two MatMulInt4 of one layout likewise) and one [2I] bias, or already from one
fused projection (Phi-3's gate_up_proj) cut by Split or two Slices of the last axis, gate half first.
Gemma's GELU MLP has no Sigmoid-gated product and is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.merge_weights import WeightSource, biased_projection, can_merge, merged_biases, merged_projection
from cann_llm.passes.pattern import FusionPass, fused_node, other_input, producer, sole_consumer


@dataclass
class SwiGluMatch:
    x: gs.Tensor
    weights: list[WeightSource] | None  # None: the input is already [gate | up]
    biases: list[np.ndarray | None]  # gate's and up's, None where it has none
    merged_input: gs.Tensor | None
    output: gs.Tensor
    name: str


def gate_up_halves(graph: gs.Graph, gate: gs.Tensor, up: gs.Tensor) -> gs.Tensor | str:
    """The [.., 2I] tensor whose halves are gate then up, when one projection was cut in two."""
    gate_node, up_node = producer(gate), producer(up)
    if gate_node is not None and gate_node is up_node and gate_node.op == "Split":
        axis = gate_node.attrs.get("axis", 0)
        rank = len(gate_node.inputs[0].shape or [])
        if len(gate_node.outputs) != 2 or axis not in (-1, rank - 1):
            return "the Split is not in two along the last axis"
        if gate_node.outputs[0] is not gate:
            return "the up half comes first"
        if len(gate_node.inputs) > 1 and isinstance(gate_node.inputs[1], gs.Constant):
            sizes = np.asarray(gate_node.inputs[1].values).reshape(-1)
            if sizes[0] != sizes[1]:
                return "the Split halves differ in size"
        return gate_node.inputs[0]
    if gate_node is None or up_node is None or gate_node.op != "Slice" or up_node.op != "Slice":
        return "gate and up are neither MatMuls nor halves of one tensor"
    whole = gate_node.inputs[0]
    if up_node.inputs[0] is not whole or whole.shape is None or not isinstance(whole.shape[-1], int):
        return "the Slices cut different tensors"
    width = whole.shape[-1]
    bounds = []
    for node in (gate_node, up_node):
        values = [np.asarray(t.values).reshape(-1) if isinstance(t, gs.Constant) else None for t in node.inputs[1:]]
        if len(values) < 3 or any(v is None or len(v) != 1 for v in values[:3]):
            return "a Slice has non-constant or multi-axis bounds"
        start, end, axis = (int(v[0]) for v in values[:3])
        if len(values) > 3 and (values[3] is None or int(values[3][0]) != 1):
            return "a Slice has a step"
        if axis not in (-1, len(whole.shape) - 1):
            return "a Slice is not on the last axis"
        bounds.append((start, min(end, width)))
    if bounds != [(0, width // 2), (width // 2, width)]:
        return f"the Slices {bounds} are not [gate | up] halves of {width}"
    return whole


class FuseSwiGlu(FusionPass):
    """Fuse gated-SiLU MLPs."""

    name = "SwiGluFusionPass"
    anchor = "Sigmoid"

    def match(self, graph: gs.Graph, sigmoid: gs.Node) -> SwiGluMatch | str:
        gate = sigmoid.inputs[0]
        silu = sole_consumer(graph, sigmoid.outputs[0], "Mul")
        if silu is None or other_input(silu, sigmoid.outputs[0]) is not gate:
            return "the Sigmoid does not form SiLU(g) = g · sigmoid(g)"
        if len(gate.outputs) != 2 or any(t is gate for t in graph.outputs):
            return "the gate value has other readers"
        product = sole_consumer(graph, silu.outputs[0], "Mul")
        up = other_input(product, silu.outputs[0]) if product is not None else None
        if up is None or isinstance(up, gs.Constant):
            return "SiLU(g) is not multiplied by an up projection"
        name = product.name.rsplit("/", 1)[0] + "/SwiGlu"
        gate_projection, up_projection = biased_projection(gate), biased_projection(up)
        if gate_projection is not None and up_projection is not None:
            x = gate_projection[0]
            weights = [gate_projection[1], up_projection[1]]
            if up_projection[0] is not x:
                return "gate and up project different inputs"
            if not can_merge(weights) or weights[0].shape != weights[1].shape:
                return "gate and up weights are not constant (or QDQ) 2-D matrices of one shape and kind"
            if len(up.outputs) != 1 or any(t is up for t in graph.outputs):
                return "the up projection has other readers"
            return SwiGluMatch(x, weights, [gate_projection[2], up_projection[2]], None, product.outputs[0], name)
        whole = gate_up_halves(graph, gate, up)
        if isinstance(whole, str):
            return whole
        return SwiGluMatch(whole, None, [], whole, product.outputs[0], name)

    def rewrite(self, graph: gs.Graph, match: SwiGluMatch) -> None:
        source = match.merged_input
        if match.weights is not None:
            shape = None if match.x.shape is None else list(match.x.shape[:-1]) + [2 * match.weights[0].shape[1]]
            source = gs.Variable(f"{match.name}_gate_up", dtype=match.output.dtype, shape=shape)
            merged_projection(graph, match.x, match.weights, source, f"{match.name}_GateUpMatMul",
                              f"{match.name}_gate_up_weight")
            source = merged_biases(graph, source, match.biases, [w.shape[1] for w in match.weights],
                                   f"{match.name}_gate_up")
        graph.nodes.append(fused_node("SwiGlu", [source], [match.output], match.name))
