"""Attention sinks (gpt-oss): a learned logit per head that joins each row's softmax and is dropped after it.

transformers writes `concat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], -1)`, subtracts the row's
maximum (which a softmax ignores), takes the softmax and keeps `[..., :-1]` for the values. The fused op
takes the sinks as its `sinks` attribute: `peel_sinks` reads them off the softmax's input, `drop_sink_column`
finds the slice that drops their column from its output.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import axes_of, const_ints, producer, sole_consumer

_LAST = (-1, 3)  # the keys' axis of [B, H, S, T] scores


def _row_max_removed(tensor: gs.Tensor) -> gs.Tensor:
    """x for `x - max(x, -1)`: a softmax of either is the same."""
    sub = producer(tensor, "Sub")
    top = producer(sub.inputs[1], "ReduceMax") if sub is not None else None
    if top is None or top.inputs[0] is not sub.inputs[0] or top.attrs.get("keepdims", 1) != 1 \
            or axes_of(top) not in ([-1], [3]):
        return tensor
    return sub.inputs[0]


def _per_head_constant(tensor: gs.Tensor) -> np.ndarray | None:
    """The values `tensor` [B, H, S, 1] repeats: a constant reshaped or unsqueezed onto the heads' axis ([1, H,
    1, 1] before the Expand), then expanded (Casts allowed); the caller checks there is one a head."""
    node = producer(tensor, "Expand")
    tensor = node.inputs[0] if node is not None else tensor
    shape = tensor.shape  # [1, H, 1, 1] (or [H, 1, 1]): the values on the heads' axis alone
    if shape is None or len(shape) not in (3, 4) or any(d != 1 for i, d in enumerate(shape) if i != len(shape) - 3):
        return None
    while (node := producer(tensor, "Reshape", "Unsqueeze", "Cast")) is not None:
        tensor = node.inputs[0]
    if not isinstance(tensor, gs.Constant) or tensor.values.ndim > 1 and sorted(tensor.values.shape)[:-1] != [1] * (
            tensor.values.ndim - 1):
        return None
    return np.asarray(tensor.values, np.float32).reshape(-1)


def peel_sinks(scores: gs.Tensor) -> tuple[gs.Tensor, tuple[float, ...]]:
    """(the scores, the sinks) of a softmax input: the concatenated scores and the sinks' values where it
    joins them (its row maximum removed or not), else (`scores`, ()). One value a query head is the caller's
    to check."""
    joined = _row_max_removed(scores)
    concat = producer(joined, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attrs.get("axis") not in _LAST:
        return scores, ()
    inner, column = concat.inputs
    if column.shape is not None and (len(column.shape) != 4 or column.shape[3] != 1):
        return scores, ()
    sinks = _per_head_constant(column)
    if sinks is None:
        return scores, ()
    return inner, tuple(float(s) for s in sinks)


def drop_sink_column(graph: gs.Graph, probabilities: gs.Tensor) -> gs.Tensor | None:
    """The output of the Slice `[..., :-1]` that alone reads `probabilities`, dropping the sinks' column."""
    cut = sole_consumer(graph, probabilities, "Slice")
    if cut is None or len(cut.inputs) < 4:
        return None
    starts, ends, axes = (const_ints(t) for t in cut.inputs[1:4])
    steps = const_ints(cut.inputs[4]) if len(cut.inputs) > 4 else [1]
    if starts != [0] or ends != [-1] or axes is None or axes[0] not in _LAST or steps != [1]:
        return None
    return cut.outputs[0]
