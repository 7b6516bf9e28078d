"""MoeFusionPass: a top-k routed block of SwiGLU experts → one cann::MoE.

Anchored at the router's TopK. What transformers' `batched_mm` experts export (both torch exporters):

    router_logits [T, E] → Softmax → TopK(k) → values, indices            (values / ReduceSum(values): renormalised)
                         (GraniteMoe: TopK(k) → Softmax(values), the renormalised form of the same weights)
    indices → Reshape[-1] → Gather(W, axis 0) | Unsqueeze(-1) → GatherND(W)    each routed expert's weights,
                                                                                copied once per token and slot
    x [T, H] → Unsqueeze(1) → Expand|Tile [1, k, 1] → Reshape|Flatten [T·k, H]  each token once per slot
    MatMul(gate_up[T·k, 2I, H], x[.., H, 1]) → Squeeze → SwiGLU (Split or Slices) → MatMul(down[T·k, H, I], ·)
    → Squeeze → Mul(Unsqueeze(Reshape[-1](values), -1)) → Reshape [T, k, H] → ReduceSum(axis 1) → y [T, H]

What transformers 4.57's loop over every expert exports (Optimum, TorchScript), unrolled, one block per expert e:

    indices → OneHot(E) → Transpose [E, k, T] → Gather(e) → Cast → NonZero → Transpose → Split → (slot, token)
    x → Unsqueeze(0) → Gather(token, axis 1) → Reshape [n, H] → MatMul(gate) | MatMul(up) → SiLU(gate) · up
    → MatMul(down) → Mul(Gather(Flatten(Unsqueeze(values, -1)), token·k + slot)) → ScatterElements(token) into
    zeros, added to the other experts' (index_add_)

The loop only runs the experts the traced tokens reached, so every expert's block is required; their [H, I]
and [I, H] MatMul weights are transposed and stacked into the batched layout above.

The router's projection stays outside (an ordinary 2-D MatMul the weight pass may quantize), and so does
Qwen2-MoE's shared expert (an ordinary SwiGLU MLP, for SwiGluFusionPass, which runs after this pass).
Matching is on structure and shapes only. The gate_up weight is stored with gate and up rows interleaved,
the layout onnxruntime's MoE kernel reads (docs/ops.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.fuse_swiglu import gate_up_halves
from cann_llm.passes.pattern import FusionPass, axes_of, const_ints, fused_node, other_input, producer, scalar, sole_consumer
from cann_llm.runtime.ops import MOE, MoEInput, positional


@dataclass
class MoeMatch:
    x: gs.Tensor
    router_logits: gs.Tensor
    gate_up: np.ndarray   # [E, 2I, H], gate half first, as batched_mm exports it
    down: gs.Constant     # [E, H, I]
    top_k: int
    normalize: int
    output: gs.Tensor
    name: str


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
    return node.inputs[0] if _is_axis(axis, axes_of(node), rank) else None


def _flattened(graph: gs.Graph, tensor: gs.Tensor) -> gs.Tensor | None:
    """The sole `Reshape(tensor, [-1])` reader of `tensor`, whose output is the flat [T·k] routing slots."""
    node = sole_consumer(graph, tensor, "Reshape")
    return node.outputs[0] if node is not None and const_ints(node.inputs[1]) == [-1] else None


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
    if repeat is None or const_ints(repeat.inputs[1]) != [1, top_k, 1]:
        return None
    x = _through(repeat.inputs[0], "Unsqueeze", 1)
    if x is None or _rank(x) != 2:
        return None
    if flat.op == "Reshape" and const_ints(flat.inputs[1]) != [-1, x.shape[-1]]:
        return None
    return x


def _silu_operands(product: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(gate, up) of `product` = SiLU(gate) · up."""
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
                return gate, up
    return None


def _silu_product(graph: gs.Graph, product: gs.Tensor) -> gs.Tensor | None:
    """The [.., 2I] [gate | up] tensor of `product` = SiLU(gate) · up."""
    operands = _silu_operands(product)
    whole = gate_up_halves(graph, *operands) if operands is not None else None
    return None if whole is None or isinstance(whole, str) else whole


def _expert_matmul(tensor: gs.Tensor, slots: gs.Tensor) -> tuple[gs.Constant, gs.Tensor] | None:
    """(weights, input rows) of `tensor` = Squeeze(MatMul(weights[expert of each slot], Unsqueeze(rows, -1)), -1)."""
    column = _through(tensor, "Squeeze", -1)
    matmul = producer(column, "MatMul") if column is not None else None
    if matmul is None:
        return None
    weights = _expert_weights(matmul.inputs[0], slots)
    rows = _through(matmul.inputs[1], "Unsqueeze", -1)
    return None if weights is None or rows is None else (weights, rows)


@dataclass
class Routing:
    """Softmax → TopK over the router's logits, and the per-slot weights the experts' outputs are scaled by."""

    logits: gs.Tensor
    top_k: int
    num_experts: int
    indices: gs.Tensor
    weights: gs.Tensor  # [T, k]: the top-k probabilities, renormalised when `normalize`
    normalize: int


def _routing(graph: gs.Graph, topk: gs.Node) -> Routing | str:
    top_k = scalar(topk.inputs[1]) if len(topk.inputs) > 1 else None
    softmax = producer(topk.inputs[0], "Softmax")
    # GraniteMoe's router: a Softmax that only the top-k logits feed
    after = sole_consumer(graph, topk.outputs[0], "Softmax") if softmax is None else None
    if top_k is None or not topk.attrs.get("largest", 1) or softmax is None and after is None:
        return "not the k largest of a Softmax, nor a Softmax of the k largest logits"
    logits = softmax.inputs[0] if softmax is not None else topk.inputs[0]
    rank = _rank(logits)
    if rank != 2 or not isinstance(logits.shape[-1], int):
        return "the router's logits are not [tokens, experts]"
    axes = [topk.attrs.get("axis", -1)], [(softmax or after).attrs.get("axis", -1)]
    if not all(_is_axis(-1, axis, rank) for axis in axes):
        return "the Softmax or TopK is not over the experts axis"
    values, indices = topk.outputs
    if after is not None:
        # softmax over the k largest logits is the k largest probabilities renormalised: the op's
        # normalize_routing_weights (the same order, so the same experts)
        return Routing(logits, int(top_k), logits.shape[-1], indices, after.outputs[0], 1)
    weights, normalize = values, 0
    total = next((n for n in values.outputs if n.op == "ReduceSum"), None)
    if total is not None:
        divide = sole_consumer(graph, total.outputs[0], "Div")
        if (len(values.outputs) != 2 or divide is None or divide.inputs[0] is not values
                or not _is_axis(-1, axes_of(total), rank) or not total.attrs.get("keepdims", 1)):
            return "the top-k probabilities are summed but not renormalised by that sum"
        weights, normalize = divide.outputs[0], 1
    return Routing(logits, int(top_k), logits.shape[-1], indices, weights, normalize)


def _match_batched(graph: gs.Graph, routing: Routing) -> MoeMatch | str:
    """transformers 5's batched_mm experts: every slot's expert weights gathered, batched MatMuls."""
    top_k, num_experts = routing.top_k, routing.num_experts
    flat_weights, slots = _flattened(graph, routing.weights), _flattened(graph, routing.indices)
    scale_node = sole_consumer(graph, flat_weights, "Unsqueeze") if flat_weights is not None else None
    if slots is None or scale_node is None or not _is_axis(-1, axes_of(scale_node), 2):
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
    target = const_ints(grouped.inputs[1]) if grouped is not None else None
    shape = grouped.outputs[0].shape if grouped is not None else None
    per_token = (target is not None and target[1:] == [top_k, hidden]) or (
        shape is not None and len(shape) == 3 and list(shape[1:]) == [top_k, hidden])
    if reduce is None or not per_token or not _is_axis(1, axes_of(reduce), 3) or reduce.attrs.get("keepdims", 1):
        return "the weighted outputs are not summed over each token's k slots"
    return MoeMatch(x, routing.logits, np.asarray(gate_up_weights.values), down_weights, top_k, routing.normalize,
                    reduce.outputs[0], reduce.name.rsplit("/", 1)[0] + "/MoE")


@dataclass
class LoopedExpert:
    """One expert's block of the unrolled loop: its weights as MatMul reads them, its rows and its share."""

    gate: np.ndarray  # [H, I]
    up: np.ndarray    # [H, I]
    down: np.ndarray  # [I, H]
    x: gs.Tensor
    contribution: gs.Node  # the ScatterElements writing its weighted rows into zeros


def _mask_positions(graph: gs.Graph, mask: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(slot, token) [n] of each nonzero of one expert's [k, T] mask: NonZero → Transpose → Split → Squeeze."""
    node = sole_consumer(graph, mask, "Cast", "NonZero")
    if node is not None and node.op == "Cast":
        node = sole_consumer(graph, node.outputs[0], "NonZero")
    pairs = sole_consumer(graph, node.outputs[0], "Transpose") if node is not None else None
    if pairs is None or list(pairs.attrs.get("perm", [])) != [1, 0]:
        return None
    split = sole_consumer(graph, pairs.outputs[0], "Split")
    if (split is None or len(split.outputs) != 2 or not _is_axis(1, [split.attrs.get("axis", 0)], 2)
            or (len(split.inputs) > 1 and const_ints(split.inputs[1]) != [1, 1])):
        return None
    columns = [sole_consumer(graph, column, "Squeeze") for column in split.outputs]
    if any(c is None or not _is_axis(1, axes_of(c), 2) for c in columns):
        return None
    return columns[0].outputs[0], columns[1].outputs[0]


def _matmul_weight(tensor: gs.Tensor) -> tuple[gs.Tensor, np.ndarray] | None:
    """(rows, W) of `tensor` = MatMul(rows, W) with W a 2-D float32 constant."""
    node = producer(tensor, "MatMul")
    if node is None or not isinstance(node.inputs[1], gs.Constant) or len(node.inputs[1].shape) != 2:
        return None
    weight = np.asarray(node.inputs[1].values)
    return (node.inputs[0], weight) if weight.dtype == np.float32 else None


def _gathered_rows(tensor: gs.Tensor, token: gs.Tensor) -> gs.Tensor | None:
    """x [T, H] when `tensor` = Reshape(Gather(Unsqueeze(x, 0), token, axis 1), [-1, H])."""
    reshape = producer(tensor, "Reshape")
    gather = producer(reshape.inputs[0], "Gather") if reshape is not None else None
    if gather is None or gather.attrs.get("axis", 0) != 1 or gather.inputs[1] is not token:
        return None
    x = _through(gather.inputs[0], "Unsqueeze", 0)
    if x is None or _rank(x) != 2 or const_ints(reshape.inputs[1]) != [-1, x.shape[-1]]:
        return None
    return x


def _slot_weight(tensor: gs.Tensor, routing: Routing, slot: gs.Tensor, token: gs.Tensor) -> bool:
    """Whether `tensor` [n, 1] is weights[token, slot]: Gather(Flatten(Unsqueeze(weights, -1)), token·k + slot)."""
    node = producer(tensor, "Reshape")
    while node is not None and tensor.shape is not None and list(tensor.shape[1:]) == [1] and _rank(tensor) == 2:
        tensor, node = node.inputs[0], producer(node.inputs[0], "Reshape")
    gather = producer(tensor, "Gather")
    flatten = producer(gather.inputs[0], "Flatten") if gather is not None else None
    if flatten is None or gather.attrs.get("axis", 0) != 0 or flatten.attrs.get("axis", 1) != 2:
        return False
    if _through(flatten.inputs[0], "Unsqueeze", -1) is not routing.weights:
        return False
    add = producer(gather.inputs[1], "Add")
    strided = other_input(add, slot) if add is not None else None
    mul = producer(strided, "Mul") if strided is not None else None
    stride = other_input(mul, token) if mul is not None else None
    return stride is not None and scalar(stride) == routing.top_k


def _looped_expert(graph: gs.Graph, mask: gs.Tensor, routing: Routing) -> LoopedExpert | str:
    positions = _mask_positions(graph, mask)
    if positions is None:
        return "its mask is not read as NonZero (slot, token) pairs"
    slot, token = positions
    index = next((sole_consumer(graph, n.outputs[0], "Expand") for n in token.outputs
                  if n.op == "Unsqueeze" and _is_axis(1, axes_of(n), 2)), None)
    scatter = sole_consumer(graph, index.outputs[0], "ScatterElements") if index is not None else None
    # ONNX makes the indices the updates' shape: the expanded token column indexes every feature of its row
    if (scatter is None or scatter.inputs[1] is not index.outputs[0] or not _is_zeros(scatter.inputs[0])
            or scatter.attrs.get("axis", 0) != 0 or scatter.attrs.get("reduction", "none") not in ("none", "add")):
        return "its rows are not scattered into zeros at their tokens"
    updates = scatter.inputs[2]
    expand = producer(updates, "Expand")
    if expand is not None and expand.inputs[0].shape == updates.shape and updates.shape is not None:
        updates = expand.inputs[0]
    weighting = producer(updates, "Mul")
    if weighting is None:
        return "its scattered rows are not scaled"
    for value, scale in (weighting.inputs, weighting.inputs[::-1]):
        down = _matmul_weight(value)
        if down is not None and _slot_weight(scale, routing, slot, token):
            break
    else:
        return "its rows are not a down projection scaled by their routing weights"
    operands = _silu_operands(down[0])
    gate, up = (_matmul_weight(t) for t in operands) if operands is not None else (None, None)
    if gate is None or up is None or gate[0] is not up[0]:
        return "its down projection does not read SiLU(gate) · up of one input's projections"
    x = _gathered_rows(gate[0], token)
    if x is None:
        return "its projections do not read the rows of its tokens"
    return LoopedExpert(gate[1], up[1], down[1], x, scatter)


def _is_zeros(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is a ConstantOfShape of zeros (its default value)."""
    node = producer(tensor, "ConstantOfShape")
    value = node.attrs.get("value") if node is not None else None
    return node is not None and (value is None or not np.any(np.asarray(value.values)))


def _summed(experts: list[LoopedExpert]) -> gs.Tensor | None:
    """The tensor zeros + Σ of every expert's scatter, when the experts' Adds chain up to exactly that."""
    scattered = {id(e.contribution.outputs[0]) for e in experts}
    adds = {id(n): n for e in experts for n in e.contribution.outputs[0].outputs if n.op == "Add"}
    if len(adds) != len(experts):
        return None
    last = [a for a in adds.values() if not any(id(reader) in adds for reader in a.outputs[0].outputs)]
    if len(last) != 1:
        return None
    total, seen = last[0].outputs[0], set()
    for _ in experts:
        add = producer(total, "Add")
        share = next((t for t in add.inputs if id(t) in scattered), None) if id(add) in adds else None
        if share is None or id(share) in seen:
            return None
        seen.add(id(share))
        total = other_input(add, share)
    return last[0].outputs[0] if _is_zeros(total) else None


def _match_loop(graph: gs.Graph, routing: Routing, onehot: gs.Node) -> MoeMatch | str:
    """transformers 4.57's loop over every expert, unrolled: each runs on the rows its one-hot mask selects."""
    num_experts = routing.num_experts
    if (const_ints(onehot.inputs[1]) != [num_experts] or const_ints(onehot.inputs[2]) != [0, 1]
            or not _is_axis(-1, [onehot.attrs.get("axis", -1)], 3)):
        return f"the expert mask is not a one-hot of the {num_experts} experts"
    permute = sole_consumer(graph, onehot.outputs[0], "Transpose")
    if permute is None or list(permute.attrs.get("perm", [])) != [2, 1, 0]:
        return "the expert mask is not permuted to [experts, slots, tokens]"
    masks: dict[int, gs.Tensor] = {}
    for node in permute.outputs[0].outputs:
        index = node.inputs[1] if node.op == "Gather" and node.attrs.get("axis", 0) == 0 else None
        expert = int(index.values) if isinstance(index, gs.Constant) and len(index.shape) == 0 else None
        if expert is None or not -num_experts <= expert < num_experts or expert % num_experts in masks:
            return "the expert mask is read other than once per expert"
        masks[expert % num_experts] = node.outputs[0]
    missing = sorted(set(range(num_experts)) - set(masks))
    if missing:
        return f"experts {missing} of {num_experts} have no block (the export never routed a token to them)"
    experts = []
    for index in range(num_experts):
        expert = _looped_expert(graph, masks[index], routing)
        if isinstance(expert, str):
            return f"expert {index}: {expert}"
        experts.append(expert)
    x = experts[0].x
    shapes = {(e.gate.shape, e.up.shape, e.down.shape) for e in experts}
    hidden = x.shape[-1]
    if any(e.x is not x for e in experts) or len(shapes) != 1 or experts[0].gate.shape[0] != hidden:
        return "the experts do not read one [tokens, hidden] input with weights of one shape"
    width = experts[0].gate.shape[1]
    if experts[0].down.shape != (width, hidden):
        return f"the down projections {experts[0].down.shape} do not fit [{width}, {hidden}]"
    output = _summed(experts)
    if output is None or output.shape != x.shape:
        return "the experts' scattered rows are not summed into one [tokens, hidden] output"
    gate_up = np.stack([np.concatenate([e.gate.T, e.up.T]) for e in experts])
    down = np.ascontiguousarray(np.stack([e.down.T for e in experts]))
    name = producer(output).name.rsplit("/", 1)[0] + "/MoE"
    return MoeMatch(x, routing.logits, gate_up, gs.Constant(f"{name}_down_weight", down), routing.top_k,
                    routing.normalize, output, name)


class FuseMoe(FusionPass):
    """Fuse top-k routed SwiGLU expert blocks, in either spelling (module docstring)."""

    name = "MoeFusionPass"
    anchor = "TopK"

    def match(self, graph: gs.Graph, topk: gs.Node) -> MoeMatch | str:
        routing = _routing(graph, topk)
        if isinstance(routing, str):
            return routing
        onehot = sole_consumer(graph, routing.indices, "OneHot")
        return _match_loop(graph, routing, onehot) if onehot is not None else _match_batched(graph, routing)

    def rewrite(self, graph: gs.Graph, match: MoeMatch) -> None:
        experts, width, hidden = match.gate_up.shape
        # [gate | up] rows → gate 0, up 0, gate 1, up 1, …
        interleaved = np.ascontiguousarray(
            match.gate_up.reshape(experts, 2, width // 2, hidden).transpose(0, 2, 1, 3)
        ).reshape(experts, width, hidden)
        gate_up = gs.Constant(f"{match.name}_gate_up_weight", interleaved)
        inputs = positional(MoEInput, {MoEInput.X: match.x, MoEInput.ROUTER_LOGITS: match.router_logits,
                                       MoEInput.GATE_UP: gate_up, MoEInput.DOWN: match.down}, gs.Variable.empty())
        graph.nodes.append(fused_node(MOE.name, inputs, [match.output], match.name, num_experts=experts, top_k=match.top_k,
                                      normalize_routing_weights=match.normalize))
