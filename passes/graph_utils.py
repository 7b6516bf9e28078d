"""Small graph-surgery helpers shared by the passes."""

from __future__ import annotations

import onnx_graphsurgeon as gs


def _swap(tensors, old: gs.Tensor, new: gs.Tensor) -> None:
    # graphsurgeon's synchronised lists keep producer/consumer links only through item assignment
    for index, tensor in enumerate(tensors):
        if tensor is old:
            tensors[index] = new


def replace_all_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every consumer of `old` (and the graph's outputs) read `new` instead."""
    for consumer in list(old.outputs):
        _swap(consumer.inputs, old, new)
    _swap(graph.outputs, old, new)


def bypass_node(graph: gs.Graph, node: gs.Node) -> bool:
    """Remove a node whose single output equals its first input; False when that would rename I/O.

    When the output is a graph output, the producer of the input is made to write the output name
    directly, so the graph's signature is unchanged.
    """
    source, result = node.inputs[0], node.outputs[0]
    if result not in graph.outputs:
        replace_all_uses(graph, result, source)
        node.outputs.clear()
        return True
    if source in graph.inputs or source in graph.outputs or isinstance(source, gs.Constant) or not source.inputs:
        return False
    producer = source.inputs[0]
    node.outputs.clear()
    _swap(producer.outputs, source, result)
    for consumer in list(source.outputs):
        _swap(consumer.inputs, source, result)
    return True
