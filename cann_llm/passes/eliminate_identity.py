"""IdentityEliminationPass: drop nodes that pass one input through unchanged.

Identity; Dropout (inference); single-input Concat/Sum/Max/Min/Mean (TorchScript's DynamicCache leaves a
one-input Concat on each past KV input); Cast to the type the value already has (TorchScript exports put
float32→float32 Casts around every RMSNorm); x·1, 1·x, x/1, x+0, 0+x, x-0 with a scalar constant of x's
type and x of rank ≥ 1 (so broadcasting changes nothing; RoPE's attention_scaling of 1.0 is one); a Slice
of whole axes (0 to the end, step 1).
Removing them lets later fusions see the real structure.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx.helper import np_dtype_to_tensor_dtype

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import bypass_node, tidy
from cann_llm.passes.pattern import const_ints, scalar

_VARIADIC = ("Concat", "Sum", "Max", "Min", "Mean")
_NEUTRAL = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}
_COMMUTATIVE = ("Mul", "Add")


def _onnx_type(dtype) -> int:
    try:
        return np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError):
        return -1


def _neutral_operand(node: gs.Node) -> gs.Tensor | None:
    """The operand of a binary op whose other operand is its neutral element."""
    orders = [(0, 1), (1, 0)] if node.op in _COMMUTATIVE else [(0, 1)]
    for x_index, c_index in orders:
        x, constant = node.inputs[x_index], node.inputs[c_index]
        if isinstance(x, gs.Constant) or x.shape is None or len(x.shape) < 1 or x.dtype is None:
            continue
        if scalar(constant) == _NEUTRAL[node.op] and np.dtype(constant.dtype) == np.dtype(x.dtype):
            return x
    return None


def passthrough_input(node: gs.Node) -> gs.Tensor | None:
    """The input a node hands on unchanged, or None if it computes something."""
    if node.op == "Identity" or node.op in _VARIADIC and len(node.inputs) == 1:
        return node.inputs[0]
    if node.op == "Dropout" and (len(node.outputs) == 1 or not node.outputs[1].outputs):
        return node.inputs[0]
    if node.op == "Cast":
        source, target = node.inputs[0], node.attrs.get("to")
        same = source.dtype is not None and target is not None and _onnx_type(source.dtype) == int(target)
        return source if same else None
    if node.op in _NEUTRAL and len(node.inputs) == 2:
        return _neutral_operand(node)
    if node.op == "Slice" and _whole_slice(node):
        return node.inputs[0]
    return None


def _whole_slice(node: gs.Node) -> bool:
    """A Slice from 0 to the end of every axis it names, step 1 (the dynamo exporter's `x[:, :]` with
    `optimize=False`)."""
    operands = [t if t.name else None for t in node.inputs] + [None] * (5 - len(node.inputs))
    starts, ends, axes, steps = (const_ints(t) if t is not None else None for t in operands[1:5])
    if starts is None or ends is None or (operands[3] is not None and axes is None):
        return False
    if operands[4] is not None and (steps is None or any(step != 1 for step in steps)):
        return False
    return all(start == 0 for start in starts) and all(end >= 2**31 - 1 for end in ends)


class EliminateIdentity:
    """Remove pass-through nodes."""

    name = "IdentityEliminationPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for node in list(graph.nodes):
            if (node.domain or "") not in ("", "ai.onnx") or len(node.outputs) < 1:
                continue
            source = passthrough_input(node)
            if source is None:
                continue
            result.match_times += 1
            if bypass_node(graph, node, source):
                result.effect_times += 1
            else:
                result.rejections.append(f"{node.name}: input and output are both graph I/O")
        tidy(graph)
        return result
