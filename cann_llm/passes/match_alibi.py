"""ALiBi's bias on the attention scores (BLOOM, MPT, Falcon-RW), read as FusedAttention's `alibi_slopes`.

    term       scale?(Cast/Reshape/Unsqueeze/Expand?(core))        scalar factors multiply the slopes
    core       Mul(slopes, positions)  or  Slice(ramp) along its last axis, step 1
    slopes     a float constant of one value a head ([H, 1], [1, H, 1, 1], ...)
    positions  CumSum(attention_mask) along the keys, moved by a constant, times the mask (BLOOM,
               Falcon-RW): the keys' positions counted over the keys the mask keeps
    ramp       a float constant [.., H, .., L], linear along its last axis for each head (MPT keeps
               m_h·(j - L + 1) for j < L)

A bias that shifts a query row by a constant leaves the row's softmax unchanged, so every one of these is
m_h·(key position - query position) to the fused op, positions counted by the mask where the term counts
them so (a key after a hole in the mask moves back), by the keys' index otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import const_ints, producer, scalar

_THROUGH = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand")


@dataclass
class Alibi:
    """What an ALiBi term adds: `slopes` (one a head, its factors multiplied in) times key positions, counted
    by `mask` (a 2-D graph input: BLOOM and Falcon-RW count the keys it keeps) or by the keys' index (None)."""

    slopes: np.ndarray
    mask: gs.Tensor | None = None


def _float_constant(tensor: gs.Tensor) -> np.ndarray | None:
    """A float constant's values (the compiler computes in float32 or wider: cann_llm/passes/upcast_float_compute.py)."""
    if not isinstance(tensor, gs.Constant):
        return None
    values = np.asarray(tensor.values)
    return values.astype(np.float64) if values.dtype.kind == "f" else None


def _per_head(values: np.ndarray) -> np.ndarray | None:
    """The values of a constant with at most one axis longer than 1 (the heads')."""
    return values.reshape(-1) if sum(n > 1 for n in values.shape) <= 1 and values.size >= 1 else None


def _input_through_casts(tensor: gs.Tensor) -> gs.Tensor | None:
    """The 2-D graph input `tensor` is, through casts (an attention mask), or None."""
    while (cast := producer(tensor, "Cast")) is not None:
        tensor = cast.inputs[0]
    graph_input = not tensor.inputs and not isinstance(tensor, gs.Constant)
    return tensor if graph_input and tensor.shape is not None and len(tensor.shape) == 2 else None


def _first_op(tensor: gs.Tensor) -> gs.Node | None:
    """The first node behind `tensor` that is not a cast or a view (None at a graph input or a constant)."""
    node = producer(tensor)
    while node is not None and node.op in _THROUGH:
        node = producer(node.inputs[0])
    return node


def _key_positions(tensor: gs.Tensor) -> tuple[float, gs.Tensor] | None:
    """(the factor on them, the mask that counts them) of the keys' positions `tensor` holds: the running
    count of a 2-D input along its last axis, moved by a constant, zeroed where that input hides a key; None
    for anything else."""
    factor, mask = 1.0, None
    for _ in range(16):
        node = _first_op(tensor)
        if node is None:
            return None
        if node.op in ("Add", "Sub") and scalar(node.inputs[1]) is not None:
            tensor = node.inputs[0]
        elif node.op == "Mul":
            first, second = node.inputs
            if scalar(second) is not None:
                factor, tensor = factor * scalar(second), first
            elif scalar(first) is not None:
                factor, tensor = factor * scalar(first), second
            elif (hidden := _input_through_casts(second)) is not None and (mask is None or mask is hidden):
                mask, tensor = hidden, first
            elif (hidden := _input_through_casts(first)) is not None and (mask is None or mask is hidden):
                mask, tensor = hidden, second
            else:
                return None
        elif node.op == "CumSum":
            counted = _input_through_casts(node.inputs[0])
            plain = not node.attrs.get("reverse", 0) and not node.attrs.get("exclusive", 0)
            if const_ints(node.inputs[1]) not in ([1], [-1]) or not plain or counted is None \
                    or not (mask is None or mask is counted):
                return None
            return factor, counted
        else:
            return None
    return None


def _ramp_slopes(slice_node: gs.Node) -> np.ndarray | None:
    """m_h of Slice(…Slice(ramp)) taking a ramp's last axis with step 1 (and anything of its axes of length 1,
    as the dynamo exporter slices MPT's [H, 1, L] buffer on both)."""
    slices = [slice_node]
    while (inner := producer(slices[-1].inputs[0], "Slice")) is not None:
        slices.append(inner)
    values = _float_constant(slices[-1].inputs[0])
    if values is None or values.ndim < 2 or values.shape[-1] < 2:
        return None
    stored = np.asarray(slices[-1].inputs[0].values).dtype
    for node in slices:
        operands = node.inputs
        axes = const_ints(operands[3]) if len(operands) > 3 and operands[3].name else None
        steps = const_ints(operands[4]) if len(operands) > 4 and operands[4].name else None
        if axes is None or len(axes) != 1 or not -values.ndim <= axes[0] < values.ndim:
            return None
        axis = axes[0] % values.ndim
        if not (axis == values.ndim - 1 and steps in (None, [1]) or values.shape[axis] == 1):
            return None
    if _per_head(values[..., 0]) is None:
        return None
    return line_slopes(values.reshape(-1, values.shape[-1]), stored)


def rounding_tolerance(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """How far each row's values, each a product rounded to `dtype`, may stray from the exact ones: a few
    units in the last place of the row's largest."""
    return 4 * float(np.finfo(dtype).eps) * np.maximum(np.abs(rows).max(axis=-1), 1e-30)


def line_slopes(rows: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """m of rows that are each a + m·j along their last axis, to `rounding_tolerance` (MPT-7B's float32 ramp
    reaches 1,700, where steps of m vary by over 1e-4 of m); None for rows that are not lines."""
    rows = rows.astype(np.float64)
    slopes = (rows[:, -1] - rows[:, 0]) / (rows.shape[-1] - 1)
    line = rows[:, :1] + slopes[:, None] * np.arange(rows.shape[-1])
    return slopes if np.all(np.abs(rows - line).max(axis=-1) <= rounding_tolerance(rows, dtype)) else None


def match_alibi(tensor: gs.Tensor) -> Alibi | None:
    """The ALiBi term `tensor` is, or None."""
    factor = 1.0
    for _ in range(16):
        node = _first_op(tensor)
        if node is None:
            return None
        if node.op in ("Mul", "Div") and scalar(node.inputs[1]) not in (None, 0.0):
            value = scalar(node.inputs[1])
            factor, tensor = factor * (value if node.op == "Mul" else 1.0 / value), node.inputs[0]
            continue
        if node.op == "Slice":
            slopes = _ramp_slopes(node)
            return None if slopes is None else Alibi((slopes * factor).astype(np.float32))
        if node.op == "Mul":
            for constant, positions in (node.inputs, node.inputs[::-1]):
                found = _float_constant(constant)
                slopes = _per_head(found) if found is not None and found.size > 1 else None
                counted = _key_positions(positions) if slopes is not None else None
                if counted is not None:
                    return Alibi((slopes * counted[0] * factor).astype(np.float32), counted[1])
        return None
    return None


def peel_alibi(tensor: gs.Tensor) -> tuple[gs.Tensor, Alibi | None]:
    """`x + term` (either order) with an ALiBi term → (x, the term); (tensor, None) when it is not one."""
    add = producer(tensor, "Add")
    if add is not None:
        for rest, term in (add.inputs, add.inputs[::-1]):
            alibi = match_alibi(term)
            if alibi is not None:
                return rest, alibi
    return tensor, None
