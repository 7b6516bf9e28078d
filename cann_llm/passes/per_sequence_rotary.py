"""PerSequenceRotaryPass: a rotary scaling that switches on the sequence's length, chosen per sequence.

Phi-3.5's and Phi-4-mini's longrope keeps two sets of inverse frequencies and rotates with the long set once
the sequence passes `original_max_position_embeddings`; transformers decides on `max(position_ids) + 1`,
which the exporters write as `Where(ReduceMax(position_ids) + 1 > L, long, short)`. In a flattened paged
batch `position_ids` holds every scheduled sequence, so one long sequence would switch all of its batch-mates
to the long set. This pass computes the rotary tables under both sets and picks, token by token, the one its
own sequence's length asks for: the switch's condition is re-evaluated on the new input `last_position_ids
[1, T]` (each token's sequence's last position, the runtime's to fill) in place of the batch's maximum.
`rotary_switch_length` reads L back from the graph for the runtime, which recomputes a sequence's cache once
it crosses L, as transformers' Phi-3 does.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx.reference import ReferenceEvaluator

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy, toposort
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import LAST_POSITIONS, PAGED_ATTENTION, input_at
from cann_llm.runtime.ops import PagedAttentionInput as Paged

_CONDITION = "rotary_switch/condition"
# ops that carry position values unchanged on the way to the reduction
_CARRIERS = ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten")
# ops between the reduction and the switch: element by element, so a per-token value goes through them too
_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "Not",
                "And", "Or", "Cast", "Identity")


class PerSequenceRotary:
    """Give each sequence of a paged batch the rotary tables its own length selects."""

    name = "PerSequenceRotaryPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        positions = next((t for t in graph.inputs if t.name == "position_ids"), None)
        reductions = [n for n in graph.nodes if n.op == "ReduceMax" and len(n.inputs) == 1
                      and "axes" not in n.attrs and _carried_from(n.inputs[0], positions) is not None]
        if positions is None or not reductions:
            return PassResult()
        if len(reductions) > 1:
            raise _refuse(f"{len(reductions)} reductions of position_ids decide it")
        rotary_inputs = {id(t): t for n in graph.nodes if n.op == PAGED_ATTENTION.name
                         for t in (input_at(n.inputs, Paged.COS), input_at(n.inputs, Paged.SIN)) if t is not None}
        last = gs.Variable(LAST_POSITIONS, dtype=positions.dtype, shape=[1, "num_tokens"])
        _select_per_token(graph, reductions[0], positions, last, rotary_inputs)
        graph.inputs.append(last)
        tidy(graph)
        if rotary_switch_length(graph) is None:  # the runtime could not tell when a sequence crosses it
            raise _refuse("its condition is not one step from one set to the other over the positions")
        return PassResult(match_times=1, effect_times=1)


def _carried_from(tensor: gs.Tensor, positions: gs.Tensor | None) -> list[gs.Node] | None:
    """The carriers from `positions` to `tensor`, first to last, or None if `tensor` is not positions."""
    chain = []
    while tensor is not positions:
        if not tensor.inputs or tensor.inputs[0].op not in _CARRIERS:
            return None
        chain.insert(0, tensor.inputs[0])
        tensor = tensor.inputs[0].inputs[0]
    return chain


def _refuse(reason: str) -> AtcError:
    return AtcError("E10055", f"the rotary scaling switches on the longest position in the batch, and {reason}: "
                              "a flattened batch cannot serve it; compile with --enable_paged_attention=0")


def _select_per_token(graph: gs.Graph, reduction: gs.Node, positions: gs.Tensor, last: gs.Tensor,
                      rotary_inputs: dict[int, gs.Tensor]) -> None:
    condition_nodes, switches = _condition(graph, reduction)
    conditions = {id(w.inputs[0]) for w in switches}
    if len(conditions) != 1:
        raise _refuse(f"its maximum decides {len(switches)} selections on {len(conditions)} conditions")
    cone, boundary = _cone(graph, switches, rotary_inputs)
    # the condition again, on each token's own sequence's last position instead of the batch's maximum
    per_token = _clone(_carried_from(reduction.inputs[0], positions), graph, "per_sequence", {id(positions): last})
    # each token's value is its sequence's maximum already: the reduction drops out
    per_token[id(reduction.outputs[0])] = per_token.get(id(reduction.inputs[0]), last)
    per_token = _clone(condition_nodes, graph, "per_sequence", per_token)
    condition = per_token[id(switches[0].inputs[0])]
    column = gs.Variable(_CONDITION, dtype=np.bool_, shape=["num_tokens", 1])
    graph.nodes.append(gs.Node("Reshape", name=_CONDITION, inputs=[
        condition, gs.Constant(f"{_CONDITION}/shape", np.array([-1, 1], np.int64))], outputs=[column]))
    taken = {label: _clone(cone, graph, label, {id(w.outputs[0]): w.inputs[index] for w in switches})
             for index, label in ((1, "when_true"), (2, "when_false"))}
    for tensor in boundary:
        chosen = gs.Variable(f"{tensor.name}/per_sequence", dtype=tensor.dtype)
        graph.nodes.append(gs.Node("Where", name=f"{tensor.name}/per_sequence", outputs=[chosen], inputs=[
            column, taken["when_true"].get(id(tensor), tensor), taken["when_false"].get(id(tensor), tensor)]))
        for consumer in list(tensor.outputs):
            if consumer.op == PAGED_ATTENTION.name:
                for index, read in enumerate(consumer.inputs):
                    if read is tensor:
                        consumer.inputs[index] = chosen


def _condition(graph: gs.Graph, reduction: gs.Node) -> tuple[list[gs.Node], list[gs.Node]]:
    """The element-wise nodes from the reduction to the `Where`s it decides, and those `Where`s."""
    nodes, switches, frontier, derived = [], [], [reduction.outputs[0]], {id(reduction.outputs[0])}
    while frontier:
        tensor = frontier.pop()
        for consumer in tensor.outputs:
            if consumer in nodes or consumer in switches:
                continue
            if consumer.op == "Where" and id(consumer.inputs[0]) in derived and \
                    not any(id(t) in derived for t in consumer.inputs[1:]):
                switches.append(consumer)
            elif consumer.op in _ELEMENTWISE:
                nodes.append(consumer)
                derived.update(id(t) for t in consumer.outputs)
                frontier += consumer.outputs
            else:
                raise _refuse(f"its maximum feeds {consumer.op} ({consumer.name})")
    if not switches:
        raise _refuse("its maximum selects nothing")
    return _in_graph_order(graph, nodes), switches


def _cone(graph: gs.Graph, switches: list[gs.Node],
          rotary_inputs: dict[int, gs.Tensor]) -> tuple[list[gs.Node], list[gs.Tensor]]:
    """What the selections feed, up to the attention's rotary tables: those nodes, and the tables."""
    nodes, boundary, frontier, seen = [], {}, [w.outputs[0] for w in switches], set()
    while frontier:
        tensor = frontier.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if not tensor.outputs:
            raise _refuse(f"{tensor.name} is a graph output")
        for consumer in tensor.outputs:
            if consumer.op == PAGED_ATTENTION.name:
                if id(tensor) not in rotary_inputs or any(t is tensor for t in consumer.inputs[:Paged.COS]):
                    raise _refuse(f"{tensor.name} reaches {consumer.name} other than as its rotary table")
                boundary[id(tensor)] = tensor
            elif consumer not in nodes:
                nodes.append(consumer)
                frontier += consumer.outputs
    return _in_graph_order(graph, nodes), list(boundary.values())


def _in_graph_order(graph: gs.Graph, nodes: list[gs.Node]) -> list[gs.Node]:
    """`nodes` producers first: the order of the graph, toposorted by the pass before this one."""
    place = {id(node): index for index, node in enumerate(graph.nodes)}
    return sorted(nodes, key=lambda node: place[id(node)])


def _clone(nodes: list[gs.Node], graph: gs.Graph, label: str, replaced: dict[int, gs.Tensor]) -> dict[int, gs.Tensor]:
    """Copies of `nodes` reading `replaced[id(tensor)]` in place of a tensor; {id(original): copy}."""
    mapping = dict(replaced)
    for node in nodes:
        outputs = [gs.Variable(f"{t.name}/{label}", dtype=t.dtype) for t in node.outputs]
        graph.nodes.append(gs.Node(node.op, name=f"{node.name}/{label}", attrs=dict(node.attrs), outputs=outputs,
                                   inputs=[mapping.get(id(t), t) for t in node.inputs]))
        mapping.update({id(t): copy for t, copy in zip(node.outputs, outputs)})
    return mapping


def rotary_switch_length(graph: gs.Graph, longest: int = 1 << 17) -> int | None:
    """L, where the pass made a switch: sequences up to L tokens long take one set of rotary tables and
    longer ones the other (the switch's condition evaluated on every last position below `longest`); None
    where there is no switch, or its condition is not one step."""
    column = next((n for n in graph.nodes if n.name == _CONDITION), None)
    last = next((t for t in graph.inputs if t.name == LAST_POSITIONS), None)
    if column is None or last is None:
        return None
    condition = column.inputs[0]
    nodes, frontier, seen = [], [condition], set()
    while frontier:  # what the condition is computed from, back to the input
        tensor = frontier.pop()
        if tensor is last or isinstance(tensor, gs.Constant) or id(tensor) in seen or not tensor.inputs:
            continue
        seen.add(id(tensor))
        if tensor.inputs[0] not in nodes:
            nodes.append(tensor.inputs[0])
        frontier += tensor.inputs[0].inputs
    try:
        sub = gs.Graph(nodes=nodes, inputs=[last], outputs=[condition], opset=graph.opset).copy()
        sub.inputs[0].shape = [1, longest]
        model = gs.export_onnx(toposort(sub))
        values = np.arange(longest, dtype=np.int64 if last.dtype in (None, np.int64) else last.dtype)[None]
        flags = np.asarray(ReferenceEvaluator(model).run(None, {LAST_POSITIONS: values})[0]).reshape(-1)
    except (onnx.checker.ValidationError, ValueError, TypeError, RuntimeError):
        return None
    changes = np.flatnonzero(np.diff(flags.astype(np.int8)))
    if flags.size != longest or len(changes) != 1:
        return None
    return int(changes[0]) + 1  # the last position where it is still false, plus one: a length
