"""Structure-aware mutation of ONNX models: attributes, wiring, shapes, dtypes, initializers, opsets, nodes
and nested subgraphs. `mutate_model(model, choices)` changes a copy of a ModelProto in 1 to 3 ways."""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

from fuzz_choices import Choices

DTYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT64,
          TensorProto.INT32, TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL, TensorProto.STRING,
          TensorProto.COMPLEX64, TensorProto.UNDEFINED, TensorProto.INT4, 99)
OPSETS = (0, 1, 6, 7, 13, 14, 17, 18, 21, 23, 24, 99, 10_000, -1)
OP_TYPES = ("Add", "MatMul", "Gather", "Reshape", "Softmax", "NoSuchOp", "If", "Loop", "FusedAttention",
            "PagedAttention", "RmsNorm", "Identity", "Cast")
DOMAINS = ("", "ai.onnx", "com.microsoft", "cann", "no.such.domain")


def _nodes(graph: onnx.GraphProto, depth: int = 0) -> list[tuple[onnx.GraphProto, onnx.NodeProto]]:
    """Every node with the graph that holds it, subgraphs included."""
    found = []
    for node in graph.node:
        found.append((graph, node))
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH and depth < 8:
                found.extend(_nodes(attr.g, depth + 1))
    return found


def _values(model: onnx.ModelProto) -> list[str]:
    graph = model.graph
    names = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    names += [out for node in graph.node for out in node.output]
    return [name for name in names if name] or ["x"]


def mutate_attribute(model: onnx.ModelProto, c: Choices, prefer_domain: str | None = None) -> None:
    """An attribute of a node (of `prefer_domain`'s nodes when there are any): a hostile value, a wrong
    type, removed, or an unknown one added."""
    nodes = [(g, n) for g, n in _nodes(model.graph) if n.attribute]
    if prefer_domain is not None:
        nodes = [(g, n) for g, n in nodes if n.domain == prefer_domain] or nodes
    if not nodes:
        return mutate_node(model, c)
    _, node = c.choice(nodes)
    attr = c.choice(list(node.attribute))
    action = c.choice(("value", "value", "value", "type", "remove", "add"), f"attribute {node.op_type}.{attr.name}")
    if action == "remove":
        node.attribute.remove(attr)
    elif action == "add":
        node.attribute.append(helper.make_attribute(c.choice(("axis", "num_heads", "kv_num_heads", "fuzz")),
                                                    c.hostile_int()))
    elif action == "type":
        replacement = c.choice((c.hostile_float(), c.hostile_string(), [c.hostile_int(), c.hostile_int()], c.hostile_int()))
        _replace_attribute(node, attr, replacement)
    elif attr.type == AttributeProto.INT:
        attr.i = _clamp64(c.hostile_int(attr.i))
    elif attr.type == AttributeProto.FLOAT:
        attr.f = c.hostile_float()
    elif attr.type == AttributeProto.INTS and attr.ints:
        attr.ints[c.integer(0, len(attr.ints) - 1)] = _clamp64(c.hostile_int())
    elif attr.type == AttributeProto.STRING:
        attr.s = c.hostile_string().encode("utf-8", "surrogatepass")
    elif attr.type == AttributeProto.TENSOR:
        mutate_tensor(attr.t, c)
    elif attr.type == AttributeProto.GRAPH:
        del attr.g.node[c.integer(0, max(0, len(attr.g.node) - 1)):]
    else:
        _replace_attribute(node, attr, c.hostile_int())
    c.note(f"-> {action}")


def _clamp64(value: int) -> int:
    return max(-(2**63), min(2**63 - 1, value))


def _replace_attribute(node: onnx.NodeProto, attr: onnx.AttributeProto, value) -> None:
    name = attr.name
    node.attribute.remove(attr)
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
    if isinstance(value, int):
        value = _clamp64(value)
    if isinstance(value, list):
        value = [_clamp64(v) for v in value]
    node.attribute.append(helper.make_attribute(name, value))


def mutate_wiring(model: onnx.ModelProto, c: Choices) -> None:
    """An input of a node pointed at another value, a missing name or nothing; or an output renamed onto
    an existing value (two producers)."""
    graph = model.graph
    if not graph.node:
        return
    node = c.choice(list(graph.node))
    values = _values(model)
    if node.input and not c.chance(3):
        index = c.integer(0, len(node.input) - 1)
        node.input[index] = c.choice((c.choice(values), "", "no_such_value", node.output[0] if node.output else "y"))
        c.note(f"rewire {node.op_type} {node.name} input {index} -> {node.input[index]}")
    elif node.output:
        index = c.integer(0, len(node.output) - 1)
        node.output[index] = c.choice((c.choice(values), ""))
        c.note(f"rewire {node.op_type} {node.name} output {index} -> {node.output[index]}")


def mutate_value_info(model: onnx.ModelProto, c: Choices) -> None:
    """A graph input's or output's dims (negative, zero, huge, symbolic, removed) or element type."""
    graph = model.graph
    values = list(graph.input) + list(graph.output)
    if not values:
        return
    value = c.choice(values)
    tensor = value.type.tensor_type
    action = c.choice(("dim", "dim", "dtype", "rank", "clear"), f"value {value.name}")
    if action == "dtype":
        tensor.elem_type = c.choice(DTYPES, "elem_type")
    elif action == "clear":
        tensor.ClearField("shape")
    elif action == "rank":
        tensor.shape.dim.add().dim_value = c.choice((1, 2, 65))
    elif tensor.shape.dim:
        dim = tensor.shape.dim[c.integer(0, len(tensor.shape.dim) - 1)]
        if c.chance(3):
            dim.dim_param = c.choice(("batch", "", "s" * 300, "1"))
        else:
            dim.dim_value = _clamp64(c.choice((-1, -7, 0, 65, 2**31, 2**40, 2**62)))
        c.note(f"dim -> {dim}".replace("\n", " "))


def mutate_tensor(tensor: onnx.TensorProto, c: Choices) -> None:
    """A tensor's dims or dtype changed without its bytes (or its bytes cut), so they disagree."""
    action = c.choice(("dims", "dtype", "truncate", "string"), f"tensor {tensor.name}")
    if action == "dims":
        if tensor.dims:
            tensor.dims[c.integer(0, len(tensor.dims) - 1)] = _clamp64(c.choice((0, -1, 2**31, 3, 10**6)))
        else:
            tensor.dims.append(c.choice((0, 2, 2**31)))
    elif action == "dtype":
        tensor.data_type = c.choice(DTYPES, "data_type")
    elif action == "truncate" and tensor.raw_data:
        tensor.raw_data = tensor.raw_data[: c.integer(0, len(tensor.raw_data) - 1)]
    else:
        count = 1
        for dim in tensor.dims:
            count *= max(dim, 0)
        strings = [b"fuzz"] * min(count, 4096)
        tensor.ClearField("raw_data")
        for field in ("float_data", "int32_data", "int64_data", "double_data"):
            tensor.ClearField(field)
        tensor.data_type = TensorProto.STRING
        tensor.string_data.extend(strings)


def mutate_initializer(model: onnx.ModelProto, c: Choices) -> None:
    if model.graph.initializer:
        mutate_tensor(c.choice(list(model.graph.initializer)), c)


def mutate_opset(model: onnx.ModelProto, c: Choices) -> None:
    """The default opset's version, a domain's version, or the IR version."""
    action = c.choice(("default", "domain", "ir", "drop"), "opset")
    if action == "ir":
        model.ir_version = c.choice((0, 1, 3, 12, 99))
    elif action == "drop" and model.opset_import:
        del model.opset_import[c.integer(0, len(model.opset_import) - 1)]
    elif action == "domain":
        entry = model.opset_import.add()
        entry.domain, entry.version = c.choice(DOMAINS[2:]), c.choice(OPSETS)
    else:
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = c.choice(OPSETS, "version")


def mutate_node(model: onnx.ModelProto, c: Choices) -> None:
    """A node dropped, duplicated (its outputs then have two producers), moved before its inputs, or given
    another op type or domain."""
    graph = model.graph
    if not graph.node:
        return
    index = c.integer(0, len(graph.node) - 1)
    node = graph.node[index]
    action = c.choice(("drop", "duplicate", "move", "op_type", "domain"), f"node {node.op_type} {node.name}")
    if action == "drop":
        del graph.node[index]
    elif action == "duplicate":
        graph.node.insert(index, onnx.NodeProto.FromString(node.SerializeToString()))
    elif action == "move":
        moved = onnx.NodeProto.FromString(node.SerializeToString())
        del graph.node[index]
        graph.node.insert(0, moved)
    elif action == "op_type":
        node.op_type = c.choice(OP_TYPES, "op_type")
    else:
        node.domain = c.choice(DOMAINS, "domain")


def nest_in_ifs(model: onnx.ModelProto, c: Choices) -> None:
    """A node replaced by `depth` nested `If`s on a constant condition, each branch computing the node on
    the outer scope's values: a valid model the compiler must fold, run or refuse in bounded time."""
    graph = model.graph
    candidates = [i for i, n in enumerate(graph.node) if n.domain in ("", "ai.onnx") and len(n.output) == 1
                  and n.op_type in ("Add", "Mul", "Sub", "Div", "MatMul", "Neg", "Sqrt", "Cast")]
    if not candidates:
        return mutate_node(model, c)
    index = c.choice(candidates)
    depth = c.integer(1, 6)
    node = graph.node[index]
    c.note(f"nest {node.op_type} {node.name} in {depth} Ifs")
    inner = onnx.NodeProto.FromString(node.SerializeToString())
    output = node.output[0]
    # a branch output needs its element type: the base models carry inferred value_info (fuzz_cases.py)
    elem_type = next((v.type.tensor_type.elem_type for v in graph.value_info if v.name == output), TensorProto.FLOAT)
    for level in range(depth):
        branch_output = f"{output}__if{level}"
        inner.output[0] = branch_output
        branch = helper.make_graph([inner], f"branch{level}", [], [helper.make_tensor_value_info(branch_output, elem_type, None)])
        cond = f"{output}__cond{level}"
        constant = helper.make_tensor(cond, TensorProto.BOOL, [], [True])
        graph.node.insert(index, helper.make_node("Constant", [], [cond], value=constant))
        index += 1
        inner = helper.make_node("If", [cond], [output], then_branch=branch, else_branch=branch, name=f"{output}__If{level}")
    graph.node[index].CopyFrom(inner)


MUTATIONS = (mutate_attribute, mutate_wiring, mutate_value_info, mutate_initializer, mutate_opset, mutate_node,
             nest_in_ifs)


def mutate_model(model: onnx.ModelProto, c: Choices) -> onnx.ModelProto:
    """A mutated copy of `model`: 1 to 3 structure-aware mutations."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for _ in range(c.integer(1, 3)):
        mutation = c.choice(MUTATIONS)
        c.note(mutation.__name__)
        mutation(model, c)
    return model
