"""ModelProto helpers shared by the compiler and the runtime."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper


def initializers_as_inputs(model: onnx.ModelProto,
                           which: Callable[[onnx.TensorProto], bool] = lambda tensor: True) -> onnx.ModelProto:
    """A copy of `model` whose initializers chosen by `which` are typed graph inputs instead; nothing else
    of the weights is copied, so the result serialises small whatever the model's size."""
    graph = model.graph
    moved = [t for t in graph.initializer if which(t)]
    kept = [t for t in graph.initializer if not which(t)]
    # `keep_initializers_as_inputs=True` (TorchScript) already lists them as inputs: listed twice is not SSA
    listed = {value.name for value in graph.input}
    inputs = list(graph.input) + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                  for t in moved if t.name not in listed]
    light = onnx.ModelProto()
    light.ir_version, light.producer_name = model.ir_version, model.producer_name
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    light.graph.CopyFrom(helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output), kept,
                                           value_info=list(graph.value_info)))
    return light


def graphs_within(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph in it (If branches, Loop and Scan bodies), nested ones too."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in (attribute.g,) if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                yield from graphs_within(sub)


def constant_operand(name: str, weights: dict[str, np.ndarray], inline: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The values of the artifact's constant `name`: a mapped weight (`weights`), or a small initializer kept in
    the graph (`inline`, by name); None when it is neither (a hostile node reading a computed tensor)."""
    if name in weights:
        return np.asarray(weights[name])
    return numpy_helper.to_array(inline[name]) if name in inline else None
