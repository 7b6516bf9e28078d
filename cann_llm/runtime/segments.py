"""Cut a graph into segments at its host nodes (../shared/DESIGN.md "The runtime").

A host node is one the runtime executes itself between onnxruntime sessions (a host kernel of the
registry in cann_llm/runtime/kernels: PagedAttention, which reads and writes the runtime's page pool). The plan
is segment 0, host 0, segment 1, ..., host n-1, segment n; segment k can only hold nodes whose inputs
exist once host nodes 0..k-1 have run. Within that, a node goes to the latest segment that still feeds
its readers in time: work that depends on weights alone (the transposed embedding a tied lm_head reads)
then lands beside its reader, where onnxruntime folds it once, instead of being recomputed and handed
across segments every step.
A graph without host nodes is one segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx
from onnx import helper

from cann_llm.runtime.errors import AtcError


@dataclass
class Segment:
    """A standalone sub-model: `inputs` come from the feeds or earlier steps, `outputs` are read later."""

    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]


@dataclass
class HostNode:
    """A node the runtime runs itself."""

    node: onnx.NodeProto


def split_at_host_nodes(model: onnx.ModelProto, is_host: Callable[[onnx.NodeProto], bool]) -> list[Segment | HostNode]:
    """The execution plan of `model`: segments and host nodes in run order (empty segments left out)."""
    graph = model.graph
    # protobuf hands out a new wrapper per access, so nodes are known by their position in this list
    nodes = list(graph.node)
    host_index = {i: k for k, i in enumerate(i for i, n in enumerate(nodes) if is_host(n))}
    if not host_index:
        names = [i.name for i in graph.input if i.name not in {t.name for t in graph.initializer}]
        return [Segment(model, names, [o.name for o in graph.output])]
    earliest = _earliest_segments(nodes, host_index)
    latest = _latest_segments(nodes, host_index, [o.name for o in graph.output])
    buckets: list[list[int]] = [[] for _ in range(len(host_index) + 1)]
    for i in range(len(nodes)):
        if i not in host_index:
            buckets[max(earliest[i], latest[i])].append(i)
    types = _value_types(model)
    initializers = {t.name: t for t in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    readers: dict[str, set[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, set()).add(i)
    hosts = [nodes[i] for i in host_index]
    plan: list[Segment | HostNode] = []
    for k, members in enumerate(buckets):
        if members:
            mine = set(members)
            # what a later step or the caller reads: another bucket's node, a host node, a graph output
            wanted = {name for i in members for name in nodes[i].output
                      if name in graph_outputs or readers.get(name, set()) - mine}
            plan.append(_segment(model, [nodes[i] for i in members], k, wanted, initializers, types))
        if k < len(hosts):
            plan.append(HostNode(hosts[k]))
    return plan


def _earliest_segments(nodes: list[onnx.NodeProto], host_index: dict[int, int]) -> list[int]:
    """Per node: the first segment after every host node it depends on."""
    level: dict[str, int] = {}
    earliest = []
    for i, node in enumerate(nodes):
        needed = max((level.get(name, 0) for name in node.input if name), default=0)
        if i in host_index:
            if needed > host_index[i]:
                raise AtcError("E13015", "the graph", f"host node {node.name} reads a value computed after it")
            needed = host_index[i] + 1
        earliest.append(needed)
        level.update((name, needed) for name in node.output)
    return earliest


def _latest_segments(nodes: list[onnx.NodeProto], host_index: dict[int, int], outputs: list[str]) -> list[int]:
    """Per node: the last segment that still runs before every reader of its outputs."""
    last = len(host_index)
    deadline = dict.fromkeys(outputs, last)
    latest = [last] * len(nodes)
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        own = host_index.get(i)
        level = own if own is not None else min((deadline.get(name, last) for name in node.output), default=last)
        latest[i] = level
        for name in node.input:
            if name:
                deadline[name] = min(deadline.get(name, last), level)
    return latest


def _segment(model: onnx.ModelProto, nodes: list[onnx.NodeProto], k: int, wanted: set[str],
             initializers: dict[str, onnx.TensorProto], types: dict[str, onnx.TypeProto]) -> Segment:
    graph = model.graph
    produced = {name for node in nodes for name in node.output if name}
    read_here = [name for node in nodes for name in node.input if name]
    inputs = list(dict.fromkeys(n for n in read_here if n not in produced and n not in initializers))
    outputs = [name for name in dict.fromkeys(n for node in nodes for n in node.output if n) if name in wanted]
    missing = [name for name in inputs + outputs if name not in types]
    if missing:
        raise AtcError("E13015", "the graph", f"no type is known for {', '.join(missing[:3])}")
    sub = helper.make_graph(
        nodes, f"{graph.name}_segment{k}",
        [helper.make_value_info(n, types[n]) for n in inputs],
        [helper.make_value_info(n, types[n]) for n in outputs],
        [initializers[n] for n in dict.fromkeys(read_here) if n in initializers])
    segment = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    segment.producer_name = model.producer_name
    return Segment(segment, inputs, outputs)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type, from the graph's I/O, its value_info (atc writes one for each tensor) and onnx's
    inference."""
    from cann_llm.runtime.proto_utils import initializers_as_inputs

    inferred = onnx.shape_inference.infer_shapes(initializers_as_inputs(model), strict_mode=False)
    types = {}
    for value in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type
    return types
