"""RmsNormFusionPass: x / sqrt(mean(x²) + eps) · w, in every spelling exporters use → cann::RmsNorm.

Anchored at the ReduceMean. Accepted: the square as Pow(x, 2) or Mul(x, x); the mean over the last axis
(attribute or input axes) with keepdims; Add of a scalar epsilon (either order, or none: 0); Sqrt then Reciprocal,
Div(1, ·) and Mul(x, ·) in either order, or Div(x, ·); Pow(·, -0.5) then Mul(x, ·) (Gemma 3n); Casts to
float32 around the normalisation; the weight Mul in either order (no weight Mul means a weight of ones;
Gemma's 1 + w arrives folded). Every intermediate value must have no other reader but the normalised value,
which may be read both by weight Muls and by others (two norms of one input an optimiser merged): each
becomes its own norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import (FusionPass, axes_of, fused_node, is_graph_output, other_input, producer, scalar,
                                    sole_consumer)


@dataclass
class RmsNormMatch:
    x: gs.Tensor
    epsilon: float
    outputs: tuple[tuple[gs.Tensor, gs.Tensor], ...]  # (weight, output) of each norm the subgraph computes
    name: str


def _weighted(graph: gs.Graph, normalized: gs.Tensor, hidden: int) -> list[tuple[gs.Tensor, gs.Tensor]] | str:
    """(weight, output) for each reader of `normalized` that scales it by a constant [hidden] weight, and
    (None, normalized) where something else reads it too. An optimiser that merged two norms of one input
    (Gemma 4's k and v norms, v's unweighted) leaves one normalisation read by both: each becomes a norm."""
    if is_graph_output(graph, normalized):
        return [(None, normalized)]
    found = []
    for reader in normalized.outputs:
        weight = other_input(reader, normalized) if reader.op == "Mul" else None
        if isinstance(weight, gs.Constant) and tuple(weight.shape) == (hidden,):
            found.append((weight, reader.outputs[0]))
        elif weight is not None and not isinstance(weight, gs.Constant) and len(normalized.outputs) == 1:
            return "the weight is not a constant"
        elif not any(output is normalized for _, output in found):  # read as it is (a Mul of another shape stays)
            found.append((None, normalized))
    return found


def _normalized(graph: gs.Graph, x: gs.Tensor, sqrt_out: gs.Tensor) -> gs.Tensor | str:
    """The value x / sqrt(...) computed from the Sqrt's output, in one of the accepted spellings."""
    step = sole_consumer(graph, sqrt_out, "Reciprocal", "Div")
    if step is None:
        return "Sqrt is not followed by Reciprocal or Div"
    if step.op == "Div" and step.inputs[0] is x and step.inputs[1] is sqrt_out:
        return step.outputs[0]
    if step.op == "Div" and not (step.inputs[1] is sqrt_out and scalar(step.inputs[0]) == 1.0):
        return "Div is neither x / rms nor 1 / rms"
    return _scaled(graph, x, step.outputs[0])


def _scaled(graph: gs.Graph, x: gs.Tensor, inverse: gs.Tensor) -> gs.Tensor | str:
    """x · (1 / rms), the inverse already computed."""
    scale = sole_consumer(graph, inverse, "Mul")
    if scale is None or other_input(scale, inverse) is not x:
        return "1 / rms does not multiply the normalised input"
    return scale.outputs[0]


class FuseRmsNorm(FusionPass):
    """Fuse RMS normalisation subgraphs."""

    name = "RmsNormFusionPass"
    anchor = "ReduceMean"

    def match(self, graph: gs.Graph, mean: gs.Node) -> RmsNormMatch | str:
        if mean.attrs.get("keepdims", 1) != 1:
            return "ReduceMean drops the reduced axis"
        square = producer(mean.inputs[0], "Pow", "Mul")
        if square is None or sole_consumer(graph, square.outputs[0]) is not mean:
            return "the mean is not of a square used only here"
        x = square.inputs[0]
        if square.op == "Pow" and scalar(square.inputs[1]) != 2.0:
            return "the Pow exponent is not 2"
        if square.op == "Mul" and square.inputs[1] is not x:
            return "the Mul is not x·x"
        rank = len(x.shape) if x.shape is not None else None
        if rank is None or axes_of(mean) not in ([-1], [rank - 1]):
            return f"the mean is not over the last axis (axes {axes_of(mean)}, rank {rank})"
        hidden = x.shape[-1]
        if not isinstance(hidden, int):
            return "the normalised size is not static"
        add = sole_consumer(graph, mean.outputs[0], "Add")
        epsilon = scalar(other_input(add, mean.outputs[0])) if add is not None else None
        if add is None and sole_consumer(graph, mean.outputs[0], "Sqrt", "Pow") is not None:
            # no epsilon: the dynamo exporter's optimiser drops Helium's 1e-8
            epsilon, add = 0.0, mean
        if epsilon is None:
            return "the mean is not followed by Add of a scalar epsilon"
        root = sole_consumer(graph, add.outputs[0], "Sqrt", "Pow")
        if root is None or (root.op == "Pow" and scalar(root.inputs[1]) != -0.5):
            return "mean + epsilon is not followed by Sqrt or Pow(·, -0.5)"
        normalized = _normalized(graph, x, root.outputs[0]) if root.op == "Sqrt" else _scaled(graph, x, root.outputs[0])
        if isinstance(normalized, str):
            return normalized
        source = x
        cast_in = producer(x, "Cast")
        cast_out = sole_consumer(graph, normalized, "Cast")
        if cast_in is not None and cast_out is not None and cast_in.inputs[0].dtype is not None:
            source = cast_in.inputs[0]
            normalized = cast_out.outputs[0]
        weighted = _weighted(graph, normalized, hidden)
        if isinstance(weighted, str):
            return weighted
        ones = gs.Constant(f"{mean.name}_ones", np.ones(hidden, dtype=np.dtype(source.dtype or np.float32)))
        outputs = [(ones if weight is None else weight, output) for weight, output in weighted]
        for weight, _ in outputs:
            if np.dtype(weight.dtype) != np.dtype(source.dtype or weight.dtype):
                return f"the weight is {weight.dtype}, the input {source.dtype}"
        return RmsNormMatch(source, epsilon, tuple(outputs), mean.name.rsplit("/", 1)[0] + "/RmsNorm")

    def rewrite(self, graph: gs.Graph, match: RmsNormMatch) -> None:
        for index, (weight, output) in enumerate(match.outputs):
            graph.nodes.append(fused_node("RmsNorm", [match.x, weight], [output],
                                          match.name + (f"_{index}" if index else ""), epsilon=match.epsilon))
