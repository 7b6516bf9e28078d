"""What a computed shape tensor holds, element by element: a number, or "dim i of tensor T".

Exporters compute reshape targets at run time (`Concat(Unsqueeze(Gather(Shape(x), 0)), [-1], [16])`).
Reading such a chain back lets a rule prove that a Reshape keeps the axes it claims to keep without
trusting symbolic shape inference, which names one run-time length differently in different places
(each past input of a dynamo export carries its own symbol).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import const_ints, producer


@dataclass(frozen=True)
class DimOf:
    """Dimension `axis` of `tensor`, read by a Shape op."""

    tensor: gs.Tensor
    axis: int

    def __eq__(self, other) -> bool:
        return isinstance(other, DimOf) and other.tensor is self.tensor and other.axis == self.axis

    def __hash__(self) -> int:
        return hash((id(self.tensor), self.axis))


Element = int | DimOf


def shape_elements(tensor: gs.Tensor, depth: int = 8) -> list[Element] | None:
    """The elements of a 1-D int64 shape tensor, or None when the chain is not one we can read."""
    constant = const_ints(tensor)
    if constant is not None:
        return constant
    node = producer(tensor)
    if node is None or depth == 0:
        return None
    if node.op == "Shape":
        rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
        if rank is None:
            return None
        start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
        return [DimOf(node.inputs[0], axis) for axis in range(rank)][slice(start, end)]
    flattening = node.op == "Reshape" and const_ints(node.inputs[1]) in ([-1], [1])
    if node.op in ("Cast", "Identity", "Squeeze", "Unsqueeze") or flattening:
        inner = shape_elements(node.inputs[0], depth - 1)
        return inner if inner is not None and len(inner) == 1 or node.op in ("Cast", "Identity") else None
    if node.op == "Concat" and node.attrs.get("axis", 0) in (0, -1):
        parts = [shape_elements(t, depth - 1) for t in node.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if node.op == "Gather" and node.attrs.get("axis", 0) == 0:
        source, indices = shape_elements(node.inputs[0], depth - 1), const_ints(node.inputs[1])
        if source is None or indices is None or any(not -len(source) <= i < len(source) for i in indices):
            return None
        return [source[i] for i in indices]
    if node.op == "Slice":
        source = shape_elements(node.inputs[0], depth - 1)
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else [0]
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1]
        if source is None or None in (starts, ends, axes, steps) or axes not in ([0], [-1]) or len(starts) != 1:
            return None
        return source[slice(starts[0], ends[0], steps[0])]
    return None


def reshape_target(node: gs.Node) -> list[Element] | None:
    """A Reshape's target with 0 entries (copy the input's dim) resolved, when it can be read."""
    target = shape_elements(node.inputs[1])
    if target is None:
        return None
    if node.attrs.get("allowzero", 0):
        return target
    return [DimOf(node.inputs[0], axis) if element == 0 else element for axis, element in enumerate(target)]


def is_dim(element: Element, tensor: gs.Tensor, axis: int) -> bool:
    """Whether `element` is known to equal dimension `axis` of `tensor`."""
    dims = tensor.shape
    static = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
    if isinstance(element, int):
        return isinstance(static, int) and static == element
    rank = len(dims) if dims is not None else None
    if element.tensor is tensor and rank is not None and element.axis % rank == axis % rank:
        return True
    other = element.tensor.shape
    theirs = other[element.axis] if other is not None and -len(other) <= element.axis < len(other) else None
    return isinstance(static, int) and theirs == static


def static_ints(tensor: gs.Tensor) -> list[int] | None:
    """The values of a 1-D integer tensor known at compile time: constants, and dims of values whose
    inferred shape fixes them (`Shape(cos)[-1]`, the rotary width TorchScript and Optimum exports read at
    run time); None when some element is only known at run time."""
    elements = shape_elements(tensor)
    if elements is None:
        return None
    values = []
    for element in elements:
        if isinstance(element, DimOf):
            dims = element.tensor.shape
            element = dims[element.axis] if dims is not None and -len(dims) <= element.axis < len(dims) else None
            if not isinstance(element, int):
                return None
        values.append(element)
    return values
