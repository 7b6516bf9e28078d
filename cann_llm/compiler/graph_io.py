"""Apply `--input_shape`, `--out_nodes` and `--output_type` to a graph's signature."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from cann_llm.compiler.config import Dim, parse_output_type
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.signature import is_carried


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


def check_geared_inputs(graph: gs.Graph, gears: tuple[dict[str, tuple[int, ...]], ...], kind: str | None) -> None:
    """Refuse gears that leave out an input sharing a geared dim (E10001): the runtime pads the inputs a gear
    names up to it, and an input the gear does not name would keep the fed size beside them (position_ids left
    at batch 3 beside input_ids padded to 4). Refuse gears (`kind` "dims" or "batch") on a graph that carries
    a cache (E10055): its length changes every step, and padded tokens would enter it."""
    if not gears:
        return
    carried = next((t.name for t in graph.inputs if is_carried(t.name)), None)
    if carried is not None:
        flag = "--dynamic_dims" if kind == "dims" else "--dynamic_batch_size"
        raise AtcError("E10055", f"{flag} with a cache input ({carried}): the cache's length changes every step, "
                                 f"which a gear cannot hold (--input_shape leaves only the geared dim free), and "
                                 f"tokens padded up to a gear would enter the cache; compile the cache export "
                                 f"without gears (LLMEngine sizes each step itself), or gear an export without a "
                                 f"cache")
    inputs = {tensor.name: list(tensor.shape or []) for tensor in graph.inputs}
    named = gears[0]
    varied = {(name, axis) for name in named for axis in range(len(named[name]))
              if len({gear[name][axis] for gear in gears}) > 1}
    symbols = {inputs[name][axis]: (name, axis) for name, axis in sorted(varied)
               if name in inputs and axis < len(inputs[name]) and isinstance(inputs[name][axis], str)}
    for name, dims in inputs.items():
        shared = next((dim for dim in dims if isinstance(dim, str) and dim in symbols), None)
        if name not in named and shared is not None:
            given = ";".join(f"{n}:{','.join('-1' if (n, a) in varied else str(d) for a, d in enumerate(shape))}"
                             for n, shape in named.items())
            geared, axis = symbols[shared]
            raise AtcError("E10001", given, "--input_shape", f"the gears vary dimension {axis} of {geared}, which "
                                                              f"{name} shares ({shared}), and {name} is not given: "
                                                              f"give every input that shares it")


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


_FLOATS = (np.float16, np.float32, np.float64)


def apply_output_type(graph: gs.Graph, output_type: str, paged: bool) -> None:
    """Float outputs cast to FP32 or FP16 at the end of the graph (integer outputs, such as ids, keep theirs):
    every one, or those `--output_type` names per output (`"node:0:FP16"`, cann_llm/compiler/config.py).

    The quantized output types need a scale per output that nothing here would consume; the engine samples
    from float32 logits and feeds a cache back as float32, so a model with a KV cache keeps FP32."""
    types = parse_output_type(output_type)
    targets = {}
    for key, kind in types.items():
        target = {"FP32": np.float32, "FP16": np.float16}.get(kind)
        if target is None:
            raise AtcError("E10055", f"--output_type={output_type}: quantized outputs are not provided; use FP32 or FP16")
        for tensor in graph.outputs if key is None else [_named_output(graph, *key)]:
            if key is not None and tensor.name in targets:  # one output named twice, by its node and its name
                raise AtcError("E10001", output_type, "--output_type", f"{tensor.name} is named more than once")
            targets[tensor.name] = target
    has_cache = paged or any(tensor.name.startswith("past_key_values") for tensor in graph.inputs)
    if has_cache and any(target is not np.float32 for target in targets.values()):
        raise AtcError("E10055", f"--output_type={output_type} on a model with a KV cache: the engine samples from "
                                 "float32 logits and feeds the cache back as float32")
    outputs = []
    for tensor in graph.outputs:
        target = targets.get(tensor.name)
        if target is None or tensor.dtype is None or np.dtype(tensor.dtype).type not in _FLOATS \
                or np.dtype(tensor.dtype) == target:
            outputs.append(tensor)
            continue
        cast = gs.Variable(tensor.name, dtype=target, shape=tensor.shape)
        tensor.name = f"{tensor.name}_before_output_type"
        graph.nodes.append(gs.Node("Cast", name=f"{cast.name}_output_type",
                                   attrs={"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))},
                                   inputs=[tensor], outputs=[cast]))
        outputs.append(cast)
    graph.outputs = outputs


def _named_output(graph: gs.Graph, node: str, index: int) -> gs.Variable:
    """The graph output that `node:index` names: that node's output, or an output of that name (index 0)."""
    outputs = {id(tensor): tensor for tensor in graph.outputs}
    for candidate in graph.nodes:
        if candidate.name == node and index < len(candidate.outputs) and id(candidate.outputs[index]) in outputs:
            return candidate.outputs[index]
    named = [tensor for tensor in graph.outputs if tensor.name == node]
    if named and index == 0:
        return named[0]
    raise AtcError("E10016", f"{node}:{index}", "output_type")
