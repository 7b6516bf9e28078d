"""Pipeline stages: a compiled paged decoder cut into contiguous layer ranges (`atc --pipeline_stages=K`), one
graph per stage, for a model served by K processes (cann_llm/runtime/engine/pipeline.py).

Stage [first, end) reads the residual stream entering layer `first` as the input `hidden_states` (the
first stage reads `input_ids` through the embedding instead) and writes the residual stream entering layer
`end` as the output `hidden_states_out` (the last stage writes `logits` through the final norm and the
head). Every stage keeps the positions and the paged metadata its attention reads; its attention nodes
address layers 0 … end-first-1 of a page pool of its own. The cut sits between a layer's residual sum and
its norm, so a stage computes exactly what the whole graph computes there: an AddRmsNorm split in two is
the same float addition and the same norm.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.decoder_layers import norm_above, norm_weight, residual_entering
from cann_llm.passes.graph_utils import replace_all_uses, toposort
from cann_llm.passes.paged_recurrent import has_recurrent_states
from cann_llm.passes.weight_memory import Deferred, read_values
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import PAGED_ATTENTION, PagedAttentionInput, input_at

HIDDEN_IN, HIDDEN_OUT = "hidden_states", "hidden_states_out"


def layer_ranges(graph: gs.Graph, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous layer ranges holding about equal weight bytes each, the head counted with the last
    (the embedding is not: a stage reads only the rows of its tokens). Each stage process then holds about
    the same memory, and the largest one, which bounds what a machine must have, is as small as it can be."""
    if has_recurrent_states(graph):
        raise _refused("its recurrent layers' states (a hybrid's) are kept by one process's engine")
    costs, head = _weight_bytes_by_layer(graph)
    num_layers = len(costs)
    if not 1 < stages <= num_layers:
        raise AtcError("E10001", stages, "--pipeline_stages",
                       f"The model has {num_layers} layers; give 2 to {num_layers} stages.")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # best[k][e]: the smallest largest stage over the first e layers cut into k stages; cut[k][e] its last start
    best = np.full((stages + 1, num_layers + 1), np.inf)
    cut = np.zeros((stages + 1, num_layers + 1), int)
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for end in range(k, num_layers + 1):
            for start in range(k - 1, end):
                weight = prefix[end] - prefix[start] + (head if k == stages and end == num_layers else 0.0)
                value = max(best[k - 1][start], weight)
                if value < best[k][end]:
                    best[k][end], cut[k][end] = value, start
    bounds, end = [num_layers], num_layers
    for k in range(stages, 0, -1):
        end = cut[k][end]
        bounds.append(end)
    bounds = [int(b) for b in bounds[::-1]]
    return list(zip(bounds, bounds[1:]))


def _weight_bytes_by_layer(graph: gs.Graph) -> tuple[list[float], float]:
    """Bytes of the constants each layer's nodes read, in layer order, and those of the nodes after the final
    norm (the head). Nodes are assigned by their place in topological order between layer starts."""
    final, attentions, starts, _ = _layers(graph)
    place = {id(node): index for index, node in enumerate(graph.nodes)}
    bounds = [place[id(start)] for start in starts] + [place[id(final)]]
    costs, head = [0.0] * len(attentions), 0.0
    known: dict[int, int | None] = {}
    for index, node in enumerate(graph.nodes):
        size = sum(_constant_bytes(t, known) or 0 for t in node.inputs)
        if index >= bounds[-1]:
            head += size
        elif index >= bounds[0]:
            costs[int(np.searchsorted(bounds, index, side="right")) - 1] += size
    return costs, head


def _constant_bytes(tensor: gs.Tensor, known: dict[int, int | None]) -> int | None:
    """The bytes of weights `tensor` is: a constant's, or those of the constants a weight-only computation
    (a tied head's transpose of the embedding) makes it from, which the stage reading it will hold; None for
    a tensor computed from the graph's inputs. `known` memoises by tensor."""
    key = id(tensor)
    if key not in known:
        if isinstance(tensor, gs.Constant):
            known[key] = int(np.prod(tensor.shape)) * np.dtype(tensor.dtype).itemsize if tensor.shape is not None else 0
        elif not tensor.inputs:
            known[key] = None  # a graph input
        else:
            known[key] = None  # until proven weight-only (and so a cycle cannot recurse)
            total = 0
            for source in tensor.inputs[0].inputs:
                size = _constant_bytes(source, known)
                if size is None:
                    break
                total += size
            else:
                known[key] = total
    return known[key]


def _layers(graph: gs.Graph) -> tuple[gs.Node, list[gs.Node], list[gs.Node], int]:
    """The toposorted graph's final norm (the one the head reads), its attention nodes in order, the norm each
    layer starts at, and the hidden size."""
    toposort(graph)
    logits = next((t for t in graph.outputs if t.name == "logits"), None)
    final = norm_above(logits, None) if logits is not None else None
    if final is None:
        raise _refused("no final norm and head compute the output 'logits'")
    hidden = norm_weight(final).shape[-1]
    attentions = [node for node in graph.nodes if node.op == PAGED_ATTENTION.name]
    # each stage sizes its own pool and reads its own layers' projections alone
    if len({(node.attrs["kv_num_heads"], node.attrs["head_dim"]) for node in attentions}) > 1:
        raise _refused("its layers' KV caches differ in size (Gemma 4's full and sliding layers)")
    keys = [input_at(node.inputs, PagedAttentionInput.KEY) for node in attentions]
    if len({id(key) for key in keys if key is not None}) < sum(key is not None for key in keys):
        raise _refused("some layers attend to an earlier layer's keys and values (Gemma 3n's and Gemma 4's last layers)")
    starts = [norm_above(node.inputs[0], hidden) for node in attentions]
    if any(start is None for start in starts):
        raise _refused("a layer's input norm was not found above its attention")
    return final, attentions, starts, hidden


def stage_graph(graph: gs.Graph, first: int, end: int) -> gs.Graph:
    """A copy of the paged `graph` computing layers [first, end) (weights shared with it, not copied)."""
    stage = graph.copy()
    _, attentions, starts, hidden = _layers(stage)
    if first > 0:
        _read_input(stage, starts[first], hidden)
    if end < len(attentions):
        _write_output(stage, starts[end], hidden)
    for layer, node in enumerate(attentions[first:end]):
        node.attrs["layer"] = layer
    stage.cleanup(remove_unused_graph_inputs=True)
    _store_weight_transposes(stage)
    toposort(stage)
    return stage


def _store_weight_transposes(graph: gs.Graph) -> None:
    """Store transposed, in column blocks of at most WEIGHT_BLOCK_BYTES, a 2-D weight that only a Transpose
    reads for one MatMul (a tied head in the last stage, where no Gather reads the embedding). onnxruntime
    holds a weight and its pre-packed copy at once while it builds a session, and here also the transpose it
    folds: with the head the largest weight by far, that sets the stage process's peak. The whole model
    keeps the transpose: there the embedding's Gather reads the same table, and storing both would double
    it."""
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for tensor in node.inputs:
            readers[tensor.name] = readers.get(tensor.name, 0) + 1
    for node in list(graph.nodes):
        source = node.inputs[0] if node.op == "Transpose" and node.inputs else None
        if not isinstance(source, gs.Constant) or readers[source.name] != 1 or len(source.shape or ()) != 2:
            continue
        transposed = node.outputs[0]
        if list(node.attrs.get("perm", [1, 0])) != [1, 0] or len(transposed.outputs) != 1:
            continue
        matmul = transposed.outputs[0]
        if matmul.op != "MatMul" or matmul.inputs[1] is not transposed:
            continue
        _column_blocks(graph, matmul, source)
        node.inputs.clear()
        node.outputs.clear()
    graph.cleanup(remove_unused_graph_inputs=True)


WEIGHT_BLOCK_BYTES = 16 << 20


def _column_blocks(graph: gs.Graph, matmul: gs.Node, source: gs.Constant) -> None:
    """`matmul` (x @ source.T) as MatMuls over column blocks of source.T, concatenated."""
    rows, columns = (int(d) for d in source.shape)
    most = max(1, WEIGHT_BLOCK_BYTES // (columns * np.dtype(source.dtype).itemsize))  # rows a block may hold
    step = -(-rows // -(-rows // most))  # as few blocks as that allows, of about equal size
    parts = []
    for index, first in enumerate(range(0, rows, step)):
        end = min(first + step, rows)
        block = gs.Constant(f"{source.name}_transposed_{index}", Deferred(
            (columns, end - first), source.dtype,
            lambda first=first, end=end: read_values(source)[first:end].T))
        part = gs.Variable(f"{matmul.outputs[0].name}_{index}", dtype=matmul.outputs[0].dtype)
        graph.nodes.append(gs.Node("MatMul", name=f"{matmul.name}_{index}", inputs=[matmul.inputs[0], block],
                                   outputs=[part]))
        parts.append(part)
    output = matmul.outputs[0]
    matmul.inputs.clear()
    matmul.outputs.clear()
    graph.nodes.append(gs.Node("Concat", name=f"{output.name}_blocks", attrs={"axis": -1}, inputs=parts,
                               outputs=[output]))


def _residual(norm: gs.Node, hidden: int) -> gs.Variable:
    entering = residual_entering(norm)
    return gs.Variable(HIDDEN_IN, dtype=entering.dtype or np.float32, shape=[1, "num_tokens", hidden])


def _read_input(graph: gs.Graph, norm: gs.Node, hidden: int) -> None:
    """Make the residual stream entering `norm`'s layer the graph input `hidden_states`."""
    fed = _residual(norm, hidden)
    graph.inputs.append(fed)
    if norm.op != "AddRmsNorm":
        replace_all_uses(graph, norm.inputs[0], fed)
        return
    normed, weight = norm.outputs[0], norm.inputs[2]
    replace_all_uses(graph, norm.outputs[1], fed)
    norm.inputs.clear()
    norm.outputs.clear()
    graph.nodes.append(gs.Node("RmsNorm", name=f"{norm.name}_stage_input", domain=norm.domain,
                               attrs=dict(norm.attrs), inputs=[fed, weight], outputs=[normed]))


def _write_output(graph: gs.Graph, norm: gs.Node, hidden: int) -> None:
    """Make the residual stream entering `norm`'s layer the graph's one output, `hidden_states_out`."""
    out = _residual(norm, hidden)
    out.name = HIDDEN_OUT
    if norm.op == "AddRmsNorm":  # its sum, computed alone: the same float addition
        graph.nodes.append(gs.Node("Add", name=f"{norm.name}_stage_output", inputs=list(norm.inputs[:2]), outputs=[out]))
    else:
        graph.nodes.append(gs.Node("Identity", name=f"{norm.name}_stage_output", inputs=[norm.inputs[0]], outputs=[out]))
    graph.outputs = [out]


def _refused(why: str) -> AtcError:
    return AtcError("E10055", f"--pipeline_stages cannot split this model: {why}")
