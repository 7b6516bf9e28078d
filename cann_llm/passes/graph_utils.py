"""Small graph-surgery helpers shared by the passes."""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx, update_import_domains
from onnx_graphsurgeon.ir.tensor import SparseValues

from cann_llm.passes.base import PassResult
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput, input_at

LIGHT_WEIGHT_LIMIT = 4096


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


def bypass_node(graph: gs.Graph, node: gs.Node, source: gs.Tensor) -> bool:
    """Remove a node whose (first) output equals its input `source`; False when that would rename I/O.

    When the output is a graph output, the producer of the input is made to write the output name
    directly, so the graph's signature is unchanged.
    """
    result = node.outputs[0]
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


def toposort(graph: gs.Graph) -> gs.Graph:
    """`graph.toposort()` in place, in the order graphsurgeon's gives (each node at 1 + its deepest producer's
    level, ties in the order graphsurgeon's depth-first walk meets them), each node visited once.

    graphsurgeon recomputes each producer lookup through generators and rebuilds every subgraph's foreign
    tensors on the way: a compile sorts its graph ~30 times, and those sorts took a fifth of the compiles in
    the test suite. One difference: a value an `If` or `Loop` body reads from this graph is found by its
    name, so its producer comes first (where the producer came after the branching node in the file,
    graphsurgeon's import gives the body a tensor of its own, with no producer, and its sort keeps that
    order). A graph with local functions (which graphsurgeon also sorts) goes to graphsurgeon's own. A
    cycle is a ValueError.
    """
    if graph.functions:
        return graph.toposort()
    # graphsurgeon's Node.subgraphs() walks a queue for every node; only a control-flow node has a body
    branching = {id(node) for node in graph.nodes if any(isinstance(v, gs.Graph) for v in node.attrs.values())}
    for node in graph.nodes:
        if id(node) in branching:
            for subgraph in node.subgraphs():
                toposort(subgraph)
    made_by = {t.name: node for node in graph.nodes for t in node.outputs if not t.is_empty()}
    local = made_by.keys() | {t.name for t in graph.inputs}
    members = {id(node) for node in graph.nodes}

    def producers(node: gs.Node) -> list[gs.Node]:
        found: dict[int, gs.Node] = {}
        for tensor in node.inputs:  # as graphsurgeon follows them: each local tensor's own producers
            if tensor.name in local:
                for producer in tensor.inputs:
                    if id(producer) in members:
                        found.setdefault(id(producer), producer)
        if id(node) in branching:  # what a branch or loop body reads from this graph, by its name
            for subgraph in node.subgraphs():
                for name in subgraph._foreign_tensors():
                    producer = made_by.get(name)
                    if producer is not None:
                        found.setdefault(id(producer), producer)
        return list(found.values())

    levels: dict[int, int] = {}  # in the order levels are found, as graphsurgeon's dict is filled
    order: list[gs.Node] = []
    for root in graph.nodes:
        if id(root) in levels:
            continue
        stack = [(root, producers(root), 0)]
        walking = {id(root)}
        while stack:
            node, inputs, at = stack[-1]
            while at < len(inputs) and id(inputs[at]) in levels:
                at += 1
            if at < len(inputs):
                nxt = inputs[at]
                if id(nxt) in walking:
                    raise ValueError(f"cycle in the graph through node {nxt.name!r}")
                stack[-1] = (node, inputs, at + 1)
                stack.append((nxt, producers(nxt), 0))
                walking.add(id(nxt))
                continue
            stack.pop()
            walking.discard(id(node))
            levels[id(node)] = 1 + max((levels[id(p)] for p in inputs), default=-1)
            order.append(node)
    graph.nodes = sorted(order, key=lambda node: levels[id(node)])
    return graph


def tidy(graph: gs.Graph) -> gs.Graph:
    """What a rewrite leaves, removed (graph inputs kept), then the graph sorted (`toposort`)."""
    return toposort(graph.cleanup(remove_unused_graph_inputs=False))


def light_model(graph: gs.Graph) -> tuple[onnx.ModelProto, dict[str, gs.Constant]]:
    """The graph as ONNX with each large constant turned into a typed graph input, and those constants.

    onnx's tools (shape inference, the version converter) serialise the model; a protobuf cannot exceed
    2 GiB, and the weights are not what they look at. Nothing large is copied, and the graph is only read:
    it is exported as graphsurgeon's exporter does, with the large constants declared as inputs rather
    than swapped for inputs in a copy of the graph (the copy made a call 4x slower: 47-54 against 12 ms on a
    tiny export, and a compile makes three calls or more).
    """
    tensors = graph.tensors()
    weights = {name: tensor for name, tensor in tensors.items() if isinstance(tensor, gs.Constant)
               and int(np.prod(tensor.shape, dtype=np.int64)) * 8 > LIGHT_WEIGHT_LIMIT}
    inputs = [OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.inputs]
    # dtype_to_onnx: a weight of a type numpy cannot name (bfloat16, float8) unloaded has its ONNX number
    inputs += [helper.make_tensor_value_info(name, dtype_to_onnx(t.dtype), list(t.shape))
               for name, t in weights.items()]
    signature = {t.name for t in list(graph.inputs) + list(graph.outputs)}
    small = [t for name, t in tensors.items() if isinstance(t, gs.Constant) and name not in weights]
    proto = helper.make_graph(
        nodes=[OnnxExporter.export_node(node) for node in graph.nodes],
        name=graph.name,
        inputs=inputs,
        outputs=[OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.outputs],
        initializer=[OnnxExporter.export_tensor_proto(t) for t in small if not isinstance(t._values, SparseValues)],
        sparse_initializer=[OnnxExporter.export_sparse_tensor_proto(t) for t in small
                            if isinstance(t._values, SparseValues)],
        value_info=[OnnxExporter.export_value_info_proto(t, do_type_check=False) for name, t in tensors.items()
                    if isinstance(t, gs.Variable) and name not in signature
                    and (t.dtype is not None or t.shape is not None)],
        doc_string=graph.doc_string,
    )
    # graphsurgeon's update_import_domains writes the domains into the graph it is given: a list of its own
    # here, so the graph keeps the opsets it had
    domains = graph.import_domains
    graph.import_domains = None if domains is None else list(domains)
    try:
        opsets = update_import_domains(graph)
    finally:
        graph.import_domains = domains
    model = helper.make_model(proto, opset_imports=opsets,
                              functions=[OnnxExporter.export_function(f) for f in graph.functions])
    model.producer_name = graph.producer_name
    model.producer_version = graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    return model, weights


def packed_constant(name: str, array: np.ndarray) -> gs.Constant:
    """A constant of a sub-byte type (int4/uint4): graphsurgeon would store one element per byte, onnx
    packs two, so the TensorProto is made by onnx and handed to graphsurgeon as is."""
    from onnx import numpy_helper
    from onnx_graphsurgeon.ir.tensor import LazyValues

    return gs.Constant(name, LazyValues(numpy_helper.from_array(array, name)))


# what may lie between the lm_head and the logits: each acts on every logit alike, so a row gathered
# before the head (cann_llm/passes/prune_logits.py) gives the same row after them
_LOGITS_PASS_THROUGH = ("Reshape", "Cast", "Identity", "Tanh")
# a bias, Granite's `logits_scaling`, Gemma 2's final softcap: one operand constant, either one
_LOGITS_CONSTANT_OPERAND = ("Add", "Sub", "Mul", "Div")


def lm_head(graph: gs.Graph, output_name: str = "logits", ops: tuple[str, ...] = ("MatMul",)) -> gs.Node | None:
    """The projection (one of `ops`) that computes `logits` (through reshapes, casts, a bias, a scale or a
    softcap, and a last move of the axes before the vocabulary's), if any."""
    tensor = next((t for t in graph.outputs if t.name == output_name), None)
    while tensor is not None and tensor.inputs:
        node = tensor.inputs[0]
        if node.op in ops:
            return node
        if node.op in _LOGITS_CONSTANT_OPERAND:
            computed = [t for t in node.inputs if not isinstance(t, gs.Constant)
                        and not (t.inputs and t.inputs[0].op == "Constant")]
            if len(computed) != 1:
                return None
            tensor = computed[0]
        elif node.op in _LOGITS_PASS_THROUGH or node.op == "Transpose" and tensor.name == output_name \
                and _keeps_last_axis(node):  # the logits moved last, as LogitsPruningPass can take them back
            tensor = node.inputs[0]
        else:
            return None
    return None


def _keeps_last_axis(transpose: gs.Node) -> bool:
    """Whether a Transpose only moves the axes before the last (ChatGLM's sequence-first logits to [B, S, V]):
    every position's logits stay the same vector."""
    perm = list(transpose.attrs.get("perm", []))
    return bool(perm) and perm[-1] == len(perm) - 1


# attention ops of onnx and onnxruntime a conversion pass left as they are (they run in onnxruntime)
_ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


def maskless_over_a_cache(graph: gs.Graph) -> int:
    """Fused attentions that read a KV cache and hide no key: an export traced with one new token over its
    cache has no mask to read (none is needed for one token), and so a prompt of several attends every key."""
    return sum(1 for node in graph.nodes if node.op == FUSED_ATTENTION.name
               and not node.attrs.get("causal", FUSED_ATTENTION.defaults["causal"])
               and input_at(node.inputs, FusedAttentionInput.PAST_KEY) is not None
               and input_at(node.inputs, FusedAttentionInput.ATTENTION_MASK) is None
               and input_at(node.inputs, FusedAttentionInput.ATTENTION_BIAS) is None)


def transposed_constant(tensor: gs.Tensor) -> gs.Constant | None:
    """The 2-D constant E when `tensor` = Transpose(E): how a lm_head tied to the embedding table reads it,
    the Transpose left unfolded when the table is large."""
    transpose = tensor.inputs[0] if tensor.inputs and tensor.inputs[0].op == "Transpose" else None
    if transpose is None or list(transpose.attrs.get("perm", [1, 0])) != [1, 0]:
        return None
    table = transpose.inputs[0]
    return table if isinstance(table, gs.Constant) and len(table.shape) == 2 else None


def unfused_attention(graph: gs.Graph) -> int:
    """Attention left as the export wrote it: Softmaxes whose probabilities multiply a MatMul (the values),
    and onnx's or onnxruntime's attention ops no conversion took."""
    return sum(1 for node in graph.nodes if node.op in _ATTENTION_OPS or node.op == "Softmax" and any(
        consumer.op == "MatMul" for out in node.outputs for consumer in _through_casts(out)))


def _through_casts(tensor: gs.Tensor) -> list[gs.Node]:
    consumers = []
    for node in tensor.outputs:
        consumers += _through_casts(node.outputs[0]) if node.op in ("Cast", "Where", "Dropout") else [node]
    return consumers


def naming_patterns(node: gs.Node, weight_name: str, head: gs.Node | None, patterns: tuple[str, ...]) -> list[str]:
    """Every pattern naming `node` (`skip_layers`, `--keep_dtype`): fnmatch on its node name or the name of
    the weight it reads; "lm_head" is `head`. All, not the first: each pattern must be known to match."""
    return [pattern for pattern in patterns if (pattern == "lm_head" and node is head) or any(
        fnmatch.fnmatchcase(name, pattern) for name in (node.name, weight_name))]


# where a position index comes from: the graph's own input, or computed from the mask or the lengths
_POSITION_SOURCES = ("CumSum", "Range")


def _positional(index: gs.Tensor, position_ids: gs.Tensor | None, depth: int = 12) -> bool:
    """Whether `index` is computed from positions (the `position_ids` input, a CumSum of the mask or a
    Range over the lengths) and not from a routing choice (TopK, ArgMax), looking `depth` nodes back."""
    seen, frontier, positional = {id(index)}, [index], False
    for _ in range(depth):
        ahead = []
        for tensor in frontier:
            positional |= tensor is position_ids
            node = tensor.inputs[0] if tensor.inputs else None
            if node is None:
                continue
            if node.op in ("TopK", "ArgMax"):
                return False
            positional |= node.op in _POSITION_SOURCES
            ahead += [t for t in node.inputs if id(t) not in seen]
            seen.update(id(t) for t in node.inputs)
        frontier = ahead
    return positional


def _constant_table(tensor: gs.Tensor) -> gs.Constant | None:
    """A constant float table of rows (a matrix, or ChatGLM's rotary cache of [rows, R/2, 2] pairs), read as
    stored or through a Cast (a table stored in half precision)."""
    if tensor.inputs and tensor.inputs[0].op == "Cast" and tensor.inputs[0].inputs:
        tensor = tensor.inputs[0].inputs[0]
    pairs = len(tensor.shape or []) == 3 and tensor.shape[-1] == 2
    if not isinstance(tensor, gs.Constant) or not (len(tensor.shape) == 2 or pairs) \
            or "float" not in np.dtype(tensor.dtype).name:
        return None
    return tensor


def position_table_rows(graph: gs.Graph) -> int | None:
    """Rows of the constant table the graph reads at each token's position (GPT-2's learned positions, a
    rotary cache stored whole): the most positions the model can read; None without one."""
    position_ids = next((t for t in graph.inputs if t.name == "position_ids"), None)
    rows = []
    for node in graph.nodes:
        # (a node a rewrite has detached has no inputs left)
        if node.op != "Gather" or len(node.inputs) != 2 or node.attrs.get("axis", 0) != 0:
            continue
        table = _constant_table(node.inputs[0])
        if table is not None and _positional(node.inputs[1], position_ids):
            rows.append(int(table.shape[0]))
    return min(rows) if rows else None


def split_into(graph: gs.Graph, packed: gs.Tensor, widths: list[int], parts: list[gs.Tensor], name: str) -> None:
    """`parts` (each taken from its producer) become the last-axis Split of `packed` by `widths`."""
    for part in parts:
        part.inputs.clear()
    if graph.opset >= 13:
        inputs, attrs = [packed, gs.Constant(f"{name}_sizes", np.asarray(widths, np.int64))], {"axis": -1}
    else:
        inputs, attrs = [packed], {"axis": -1, "split": widths}
    graph.nodes.append(gs.Node("Split", name=name, attrs=attrs, inputs=inputs, outputs=list(parts)))


class CanonicalNodes:
    """The nodes a canonicalisation writes in place of the subgraph ending at `name`: each output named after
    it, in `dtype`; `done()` adds them to the graph."""

    def __init__(self, name: str, dtype):
        self.name, self.dtype, self.nodes = name, dtype, []

    def node(self, op: str, inputs: list, attrs: dict | None = None, shape=None) -> gs.Tensor:
        out = gs.Variable(f"{self.name}/canonical_{len(self.nodes)}", dtype=self.dtype, shape=shape)
        self.nodes.append(gs.Node(op, f"{self.name}/Canonical{op}_{len(self.nodes)}", attrs or {}, inputs, [out]))
        return out

    def const(self, label: str, values) -> gs.Constant:
        return gs.Constant(f"{self.name}/canonical_{label}", np.array(values, np.int64))

    def done(self, graph: gs.Graph) -> None:
        graph.nodes.extend(self.nodes)


def rewrite_each(graph: gs.Graph, candidates: list[gs.Node], match, rewrite) -> PassResult:
    """`rewrite(node, *found)` for each candidate whose `match(node)` finds something (None: not one), then one
    cleanup where anything changed: a canonicalisation, whose non-matches nobody needs told (a FusionPass
    reports each refusal)."""
    result = PassResult()
    for node in candidates:
        found = match(node)
        if found is None:
            continue
        result.match_times += 1
        rewrite(node, *found)
        result.effect_times += 1
    if result.effect_times:
        tidy(graph)
    return result
