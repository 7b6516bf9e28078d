"""MoeFusionPass: a top-k routed block of SwiGLU experts → one cann::MoE.

Anchored at the router's TopK. What transformers' `batched_mm` experts export (both torch exporters):

    router_logits [T, E] → Softmax → TopK(k) → values, indices            (values / ReduceSum(values): renormalised)
    indices → Reshape[-1] → Gather(W, axis 0) | Unsqueeze(-1) → GatherND(W)    each routed expert's weights,
                                                                                copied once per token and slot
    x [T, H] → Unsqueeze(1) → Expand|Tile [1, k, 1] → Reshape|Flatten [T·k, H]  each token once per slot
    MatMul(gate_up[T·k, 2I, H], x[.., H, 1]) → Squeeze → SwiGLU (Split or Slices) → MatMul(down[T·k, H, I], ·)
    → Squeeze → Mul(Unsqueeze(Reshape[-1](values), -1)) → Reshape [T, k, H] → ReduceSum(axis 1) → y [T, H]

The router's projection stays outside (an ordinary 2-D MatMul the weight pass may quantize), and so does
Qwen2-MoE's shared expert (an ordinary SwiGLU MLP, for SwiGluFusionPass, which runs after this pass).
Matching is on structure and shapes only. The gate_up weight is stored with gate and up rows interleaved,
the layout onnxruntime's MoE kernel reads (docs/ops.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse_swiglu import gate_up_halves
from passes.pattern import FusionPass, fused_node, other_input, producer, scalar, sole_consumer


@dataclass
class MoeMatch:
    x: gs.Tensor
    router_logits: gs.Tensor
    gate_up: gs.Constant  # [E, 2I, H], gate half first, as exported
    down: gs.Constant     # [E, H, I]
    top_k: int
    normalize: int
    output: gs.Tensor
    name: str


def _ints(tensor: gs.Tensor | None) -> list[int] | None:
    if not isinstance(tensor, gs.Constant):
        return None
    return [int(v) for v in np.asarray(tensor.values).reshape(-1)]


def _axes(node: gs.Node) -> list[int] | None:
    """Unsqueeze/Squeeze/ReduceSum axes, an attribute before opset 13 and an input from it on."""
    if len(node.inputs) > 1:
        return _ints(node.inputs[1])
    axes = node.attrs.get("axes")
    return None if axes is None else list(axes)


def _is_axis(axis: int, axes: list[int] | None, rank: int | None) -> bool:
    return axes is not None and len(axes) == 1 and rank is not None and axes[0] % rank == axis % rank


def _rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def _through(tensor: gs.Tensor, op: str, axis: int) -> gs.Tensor | None:
    """The input of the Unsqueeze or Squeeze of `axis` (of its output's or input's rank) producing `tensor`."""
    node = producer(tensor, op)
    if node is None:
        return None
    rank = _rank(node.outputs[0]) if op == "Unsqueeze" else _rank(node.inputs[0])
    return node.inputs[0] if _is_axis(axis, _axes(node), rank) else None


def _flattened(graph: gs.Graph, tensor: gs.Tensor) -> gs.Tensor | None:
    """The sole `Reshape(tensor, [-1])` reader of `tensor`, whose output is the flat [T·k] routing slots."""
    node = sole_consumer(graph, tensor, "Reshape")
    return node.outputs[0] if node is not None and _ints(node.inputs[1]) == [-1] else None


def _expert_weights(gathered: gs.Tensor, slots: gs.Tensor) -> gs.Constant | None:
    """The [E, ·, ·] float32 constant whose experts `gathered` selects by the routing slots."""
    node = producer(gathered, "Gather", "GatherND")
    if node is None or not isinstance(node.inputs[0], gs.Constant) or len(node.inputs[0].shape) != 3:
        return None
    if node.op == "Gather":
        selected = node.attrs.get("axis", 0) == 0 and node.inputs[1] is slots
    else:
        selected = node.attrs.get("batch_dims", 0) == 0 and _through(node.inputs[1], "Unsqueeze", -1) is slots
    return node.inputs[0] if selected and np.dtype(node.inputs[0].dtype) == np.float32 else None


def _repeated_tokens(tensor: gs.Tensor, top_k: int) -> gs.Tensor | None:
    """x [T, H] when `tensor` is each of its rows repeated k times in a row ([T·k, H], token-major)."""
    flat = producer(tensor, "Reshape", "Flatten")
    if flat is None:
        return None
    if flat.op == "Flatten" and flat.attrs.get("axis", 1) != 2:
        return None
    repeat = producer(flat.inputs[0], "Expand", "Tile")
    if repeat is None or _ints(repeat.inputs[1]) != [1, top_k, 1]:
        return None
    x = _through(repeat.inputs[0], "Unsqueeze", 1)
    if x is None or _rank(x) != 2:
        return None
    if flat.op == "Reshape" and _ints(flat.inputs[1]) != [-1, x.shape[-1]]:
        return None
    return x


def _silu_product(graph: gs.Graph, product: gs.Tensor) -> gs.Tensor | None:
    """The [.., 2I] [gate | up] tensor of `product` = SiLU(gate) · up."""
    mul = producer(product, "Mul")
    if mul is None:
        return None
    for silu, up in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        silu_mul = producer(silu, "Mul")
        if silu_mul is None:
            continue
        for gate, sig in ((silu_mul.inputs[0], silu_mul.inputs[1]), (silu_mul.inputs[1], silu_mul.inputs[0])):
            sigmoid = producer(sig, "Sigmoid")
            if sigmoid is not None and sigmoid.inputs[0] is gate:
                whole = gate_up_halves(graph, gate, up)
                return None if isinstance(whole, str) else whole
    return None


def _expert_matmul(tensor: gs.Tensor, slots: gs.Tensor) -> tuple[gs.Constant, gs.Tensor] | None:
    """(weights, input rows) of `tensor` = Squeeze(MatMul(weights[expert of each slot], Unsqueeze(rows, -1)), -1)."""
    column = _through(tensor, "Squeeze", -1)
    matmul = producer(column, "MatMul") if column is not None else None
    if matmul is None:
        return None
    weights = _expert_weights(matmul.inputs[0], slots)
    rows = _through(matmul.inputs[1], "Unsqueeze", -1)
    return None if weights is None or rows is None else (weights, rows)


class FuseMoe(FusionPass):
    """Fuse top-k routed SwiGLU expert blocks."""

    name = "MoeFusionPass"
    anchor = "TopK"

    def match(self, graph: gs.Graph, topk: gs.Node) -> MoeMatch | str:
        top_k = scalar(topk.inputs[1]) if len(topk.inputs) > 1 else None
        softmax = producer(topk.inputs[0], "Softmax")
        if top_k is None or not topk.attrs.get("largest", 1) or softmax is None:
            return "not the k largest of a Softmax"
        logits = softmax.inputs[0]
        rank = _rank(logits)
        if rank != 2 or not isinstance(logits.shape[-1], int):
            return "the router's logits are not [tokens, experts]"
        axes = [topk.attrs.get("axis", -1)], [softmax.attrs.get("axis", -1)]
        if not all(_is_axis(-1, axis, rank) for axis in axes):
            return "the Softmax or TopK is not over the experts axis"
        top_k, num_experts = int(top_k), logits.shape[-1]
        values, indices = topk.outputs
        weights, normalize = values, 0
        total = next((n for n in values.outputs if n.op == "ReduceSum"), None)
        if total is not None:
            divide = sole_consumer(graph, total.outputs[0], "Div")
            if (len(values.outputs) != 2 or divide is None or divide.inputs[0] is not values
                    or not _is_axis(-1, _axes(total), rank) or not total.attrs.get("keepdims", 1)):
                return "the top-k probabilities are summed but not renormalised by that sum"
            weights, normalize = divide.outputs[0], 1
        flat_weights, slots = _flattened(graph, weights), _flattened(graph, indices)
        scale_node = sole_consumer(graph, flat_weights, "Unsqueeze") if flat_weights is not None else None
        if slots is None or scale_node is None or not _is_axis(-1, _axes(scale_node), 2):
            return "the routing weights and experts are not flattened to one slot per row"
        scale = scale_node.outputs[0]
        weighting = sole_consumer(graph, scale, "Mul")
        if weighting is None:
            return "the routing weights do not scale the experts' outputs"
        down = _expert_matmul(other_input(weighting, scale), slots)
        if down is None:
            return "the weighted value is not a routed expert's down projection"
        down_weights, activated = down
        projected = _silu_product(graph, activated)
        gate_up = _expert_matmul(projected, slots) if projected is not None else None
        if gate_up is None:
            return "the down projection does not read SiLU(gate) · up of a routed expert's gate_up projection"
        gate_up_weights, repeated = gate_up
        x = _repeated_tokens(repeated, top_k)
        if x is None:
            return "the experts do not read each token once per routing slot"
        hidden = x.shape[-1]
        experts, width, _ = gate_up_weights.shape
        if (experts != num_experts or tuple(down_weights.shape) != (num_experts, hidden, width // 2)
                or gate_up_weights.shape[2] != hidden or width % 2):
            return (f"expert weights {gate_up_weights.shape} and {down_weights.shape} do not fit {num_experts} "
                    f"experts of hidden size {hidden}")
        grouped = sole_consumer(graph, weighting.outputs[0], "Reshape")
        reduce = sole_consumer(graph, grouped.outputs[0], "ReduceSum") if grouped is not None else None
        target = _ints(grouped.inputs[1]) if grouped is not None else None
        shape = grouped.outputs[0].shape if grouped is not None else None
        per_token = (target is not None and target[1:] == [top_k, hidden]) or (
            shape is not None and len(shape) == 3 and list(shape[1:]) == [top_k, hidden])
        if reduce is None or not per_token or not _is_axis(1, _axes(reduce), 3) or reduce.attrs.get("keepdims", 1):
            return "the weighted outputs are not summed over each token's k slots"
        return MoeMatch(x, logits, gate_up_weights, down_weights, top_k, normalize, reduce.outputs[0],
                        reduce.name.rsplit("/", 1)[0] + "/MoE")

    def rewrite(self, graph: gs.Graph, match: MoeMatch) -> None:
        experts, width, hidden = match.gate_up.shape
        # [gate | up] rows → gate 0, up 0, gate 1, up 1, …
        interleaved = np.ascontiguousarray(
            np.asarray(match.gate_up.values).reshape(experts, 2, width // 2, hidden).transpose(0, 2, 1, 3)
        ).reshape(experts, width, hidden)
        gate_up = gs.Constant(f"{match.name}_gate_up_weight", interleaved)
        graph.nodes.append(fused_node("MoE", [match.x, match.router_logits, gate_up, match.down], [match.output],
                                      match.name, num_experts=experts, top_k=match.top_k,
                                      normalize_routing_weights=match.normalize))
