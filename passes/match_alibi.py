"""ALiBi's bias on the attention scores (BLOOM, MPT, Falcon-RW), read as FusedAttention's `alibi_slopes`.

    term       scale?(Cast/Reshape/Unsqueeze/Expand?(core))        scalar factors multiply the slopes
    core       Mul(slopes, positions)  or  Slice(ramp) along its last axis, step 1
    slopes     a float constant of one value a head ([H, 1], [1, H, 1, 1], ...)
    positions  CumSum(attention_mask) along the keys, moved by a constant, times the mask (BLOOM,
               Falcon-RW), or Range(start, end, 1): the keys' positions, through casts and unsqueezes
    ramp       a float constant [.., H, .., L], linear along its last axis for each head (MPT keeps
               m_h·(j - L + 1) for j < L)

A bias that shifts a query row by a constant leaves the row's softmax unchanged, so every one of these is
m_h·(key position - query position) to the fused op: a left-padded row's keys sit at their index minus its
padding, a constant again.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from passes.pattern import const_ints, producer, scalar

_THROUGH = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand")
_RAMP_RTOL = 1e-4


def _float_constant(tensor: gs.Tensor) -> np.ndarray | None:
    if not isinstance(tensor, gs.Constant):
        return None
    values = np.asarray(tensor.values)
    # bfloat16 (Falcon's slopes) reads as ml_dtypes' type, of kind "V"
    return values.astype(np.float32).astype(np.float64) if values.dtype.kind in "fV" else None


def _per_head(values: np.ndarray) -> np.ndarray | None:
    """The values of a constant with at most one axis longer than 1 (the heads')."""
    return values.reshape(-1) if sum(n > 1 for n in values.shape) <= 1 and values.size >= 1 else None


def _is_mask_input(tensor: gs.Tensor) -> bool:
    """A 2-D graph input of integers or booleans, through casts: the attention mask."""
    while (cast := producer(tensor, "Cast")) is not None:
        tensor = cast.inputs[0]
    return not tensor.inputs and not isinstance(tensor, gs.Constant) and tensor.shape is not None \
        and len(tensor.shape) == 2


def _key_positions(tensor: gs.Tensor) -> float | None:
    """The factor on the keys' positions that `tensor` holds (positions moved by a constant, or zeroed
    where the mask hides a key, count as positions), or None when it is something else."""
    factor = 1.0
    for _ in range(16):
        node = producer(tensor)
        if node is None:
            return None
        if node.op in _THROUGH:
            tensor = node.inputs[0]
        elif node.op in ("Add", "Sub") and scalar(node.inputs[1]) is not None:
            tensor = node.inputs[0]
        elif node.op == "Mul":
            first, second = node.inputs
            if scalar(second) is not None:
                factor, tensor = factor * scalar(second), first
            elif scalar(first) is not None:
                factor, tensor = factor * scalar(first), second
            elif _is_mask_input(second):
                tensor = first
            elif _is_mask_input(first):
                tensor = second
            else:
                return None
        elif node.op == "CumSum":
            axis = const_ints(node.inputs[1])
            return factor if axis in ([1], [-1]) and _is_mask_input(node.inputs[0]) else None
        elif node.op == "Range":
            return factor if scalar(node.inputs[2]) == 1 else None
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
    for node in slices:
        operands = node.inputs
        axes = const_ints(operands[3]) if len(operands) > 3 and operands[3].name else None
        steps = const_ints(operands[4]) if len(operands) > 4 and operands[4].name else None
        if axes is None or len(axes) != 1 or not -values.ndim <= axes[0] < values.ndim:
            return None
        axis = axes[0] % values.ndim
        if not (axis == values.ndim - 1 and steps in (None, [1]) or values.shape[axis] == 1):
            return None
    heads = _per_head(values[..., 0])
    if heads is None:
        return None
    rows = values.reshape(-1, values.shape[-1])
    step = np.diff(rows, axis=-1)
    if not np.allclose(step, step[:, :1], rtol=_RAMP_RTOL, atol=1e-7 * np.abs(step).max()):
        return None
    return step[:, 0]


def match_alibi(tensor: gs.Tensor) -> np.ndarray | None:
    """The per-head slopes (float32, any scalar factors on the term multiplied in) of an ALiBi term, or None."""
    factor = 1.0
    for _ in range(16):
        node = producer(tensor)
        if node is None:
            return None
        if node.op in _THROUGH:
            tensor = node.inputs[0]
            continue
        if node.op in ("Mul", "Div") and scalar(node.inputs[1]) not in (None, 0.0):
            value = scalar(node.inputs[1])
            factor, tensor = factor * (value if node.op == "Mul" else 1.0 / value), node.inputs[0]
            continue
        if node.op == "Slice":
            slopes = _ramp_slopes(node)
            return None if slopes is None else (slopes * factor).astype(np.float32)
        if node.op == "Mul":
            for constant, positions in (node.inputs, node.inputs[::-1]):
                values = _float_constant(constant)
                slopes = _per_head(values) if values is not None and values.size > 1 else None
                scale = _key_positions(positions) if slopes is not None else None
                if scale is not None:
                    return (slopes * scale * factor).astype(np.float32)
        return None
    return None


def peel_alibi(tensor: gs.Tensor) -> tuple[gs.Tensor, np.ndarray | None]:
    """`x + term` (either order) with an ALiBi term → (x, slopes); (tensor, None) when it is not one."""
    add = producer(tensor, "Add")
    if add is not None:
        for rest, term in (add.inputs, add.inputs[::-1]):
            slopes = match_alibi(term)
            if slopes is not None:
                return rest, slopes
    return tensor, None
