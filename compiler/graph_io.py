"""Apply `--input_shape` and `--out_nodes` to a graph's signature."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from compiler.config import Dim
from runtime.errors import AtcError


def apply_input_shape(graph: gs.Graph, shapes: dict[str, tuple[Dim, ...]]) -> None:
    """Fix the dims given as positive ints; -1 and `low~high` ranges stay dynamic."""
    inputs = {tensor.name: tensor for tensor in graph.inputs}
    for name, dims in shapes.items():
        tensor = inputs.get(name)
        if tensor is None:
            raise AtcError("E10016", name, "input_shape")
        current = list(tensor.shape) if tensor.shape is not None else [None] * len(dims)
        if len(current) != len(dims):
            raise AtcError("E10049", len(dims), len(current))
        for axis, dim in enumerate(dims):
            if isinstance(dim, int) and dim > 0:
                if isinstance(current[axis], int) and current[axis] > 0 and current[axis] != dim:
                    raise AtcError("E10001", f"{name}:{dim}", "--input_shape",
                                   f"dimension {axis} of {name} is fixed to {current[axis]} in the model")
                current[axis] = dim
            elif not isinstance(current[axis], str):
                current[axis] = f"{name}_dim{axis}"
        tensor.shape = current


def apply_out_nodes(graph: gs.Graph, out_nodes: tuple[str, ...]) -> None:
    """Make the named tensors (`name`, or `node:index`) the graph's outputs, in the order given."""
    tensors = graph.tensors()
    nodes = {node.name: node for node in graph.nodes}
    outputs = []
    for item in out_nodes:
        node_name, sep, index = item.rpartition(":")
        if sep and index.isdigit() and node_name in nodes and int(index) < len(nodes[node_name].outputs):
            outputs.append(nodes[node_name].outputs[int(index)])
        elif item in tensors and not isinstance(tensors[item], gs.Constant):
            outputs.append(tensors[item])
        else:
            raise AtcError("E10016", item, "out_nodes")
    graph.outputs = outputs
