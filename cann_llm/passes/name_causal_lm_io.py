"""CausalLmIoNamingPass: the inputs and output a causal LM's runtime reads by name, found by structure where
the export named them otherwise.

`torch.onnx.export(model, (input_ids, attention_mask), path, dynamo=True, dynamic_shapes=...)` on a
transformers model, without `output_names`, names the logits after the node that computed them
(`linear_14`); TorchScript without `input_names` names the inputs after the forward's arguments with a
suffix (`attention_mask.1`). The engine, the paged rewrite and logits pruning read `input_ids`,
`attention_mask`, `position_ids` and `logits`, so those are renamed here, first of all passes:

    input_ids       the one rank-2 integer input whose values index the rows of a 2-D table (the embedding),
                    through Reshapes, Casts and Flattens
    logits          the one float rank-3 output as wide as that table has rows (not a base model's
                    hidden states)
    past_key_values.N.key, .value
                    the rank-4 float inputs that a Concat on the sequence axis appends the new keys or values
                    to (through a sliding-window Slice): a key where the attention's scores are computed
                    from it (a MatMul whose product reaches a Softmax), else a value; a key and a value
                    per attention (the MatMul the probabilities reach), N the order of those. The
                    exporter's own names (`past_0`, `past_key_values_0_0`, `past_key_values.layers.0.keys`)
                    say nothing the engine can rely on.
    present.N.key, .value
                    the graph output each cache input's Concat gives (the cache carried to the next step),
                    whether its input was named by the exporter or here
    attention_mask, position_ids, input_ids
                    an input named so with TorchScript's `.N` suffix

A graph that already has a name, or where the choice is not unique, is left as it is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.match_attention import dtype_kind
from cann_llm.runtime.signature import PAST_NAME, present_name

log = logging.getLogger(__name__)

TOKEN_INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
_PASSED_ON = ("Reshape", "Cast", "Flatten", "Squeeze", "Unsqueeze")
_SUFFIX = re.compile(r"^(.+)\.\d+$")


def _table_rows(tensor: gs.Tensor) -> int | None:
    """The rows of the 2-D table whose rows `tensor`'s values pick (Gather on axis 0), following the value
    through ops that pass it on; None if it indexes none."""
    queue, seen = [tensor], set()
    while queue:
        value = queue.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for node in value.outputs:
            if node.op == "Gather" and node.inputs[1] is value and node.attrs.get("axis", 0) == 0:
                table = node.inputs[0]
                if table.shape is not None and len(table.shape) == 2 and isinstance(table.shape[0], int):
                    return table.shape[0]
            elif node.op in _PASSED_ON and node.inputs[0] is value:
                queue.extend(node.outputs)
    return None


def _rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def token_input(graph: gs.Graph) -> gs.Tensor | None:
    """The graph input that is input_ids, by name or, as this pass would name it, by structure."""
    by_name = [t for t in graph.inputs if t.name == "input_ids" or
               ((match := _SUFFIX.match(t.name)) is not None and match.group(1) == "input_ids")]
    if by_name:
        return by_name[0]
    indexing = [t for t in graph.inputs if _rank(t) == 2 and dtype_kind(t.dtype) in "iu" and _table_rows(t) is not None]
    return indexing[0] if len(indexing) == 1 else None


_CARRIED = ("Identity", "Slice", "Cast")  # from a cache's Concat to its present output
_SEARCH = 12  # nodes from a cache's Concat to the MatMul that reads it, and from there to the Softmax


def _appended(past: gs.Tensor) -> gs.Node | None:
    """The Concat on the sequence axis of rank-4 `past` (its first operand, possibly through a Slice that
    keeps a sliding window's tail) that appends the new entries."""
    if past.shape is None or len(past.shape) != 4 or dtype_kind(past.dtype) not in "fV":
        return None
    # TorchScript's DynamicCache passes each past through a one-input Concat first
    aliases = [past]
    for value in aliases:
        aliases += [n.outputs[0] for n in value.outputs
                    if n.op == "Identity" or n.op == "Concat" and len(n.inputs) == 1]
    kept = [*aliases, *(s.outputs[0] for a in aliases for s in a.outputs if s.op == "Slice")]
    concats = [n for a in kept for n in a.outputs if n.op == "Concat" and len(n.inputs) == 2
               and n.attrs.get("axis") in (2, -2) and any(n.inputs[0] is k for k in kept)]
    return concats[0] if len(concats) == 1 else None


def _reached(start: gs.Tensor, stop: Callable[[gs.Node], bool]) -> tuple[gs.Node, gs.Tensor] | None:
    """The first node (breadth first, within _SEARCH nodes, not through a MatMul) reading a value computed
    from `start` for which `stop(node)` holds, and the value it reads."""
    queue, seen = [start], set()
    while queue and len(seen) < _SEARCH * 4:
        value = queue.pop(0)
        for node in value.outputs:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if stop(node):
                return node, value
            if node.op != "MatMul":
                queue.extend(node.outputs)
    return None


def _cache_kind(concat: gs.Node) -> tuple[gs.Node, str] | None:
    """(the attention the cache belongs to, "key" or "value"): that attention's probabilities·values
    MatMul (or ONNX's Attention op, by the operand it reads). A cache whose first MatMul leads to a Softmax
    holds keys, and its attention is the MatMul the Softmax's probabilities reach; otherwise it holds
    values, and its attention is that first MatMul."""
    found = _reached(concat.outputs[0], lambda node: node.op in ("MatMul", "Attention"))
    if found is None:
        return None
    reader, operand = found
    if reader.op == "Attention":
        index = next(i for i, t in enumerate(reader.inputs) if t is operand)
        return (reader, {1: "key", 2: "value"}[index]) if index in (1, 2) else None
    scores = _reached(reader.outputs[0], lambda node: node.op in ("Softmax", "MatMul"))
    if scores is None or scores[0].op != "Softmax":
        return reader, "value"
    context = _reached(scores[0].outputs[0], lambda node: node.op == "MatMul")
    return (context[0], "key") if context is not None else None


def _present(concat: gs.Node, outputs: list[gs.Tensor]) -> gs.Tensor | None:
    """The graph output that carries `concat`'s cache: its output, or that through Identity, Slice (a
    sliding window's tail) or Cast."""
    ids, values = {id(t) for t in outputs}, [concat.outputs[0]]
    for _ in range(4):
        found = [value for value in values if id(value) in ids]
        if found:
            return found[0] if len(found) == 1 else None
        values = [node.outputs[0] for value in values for node in value.outputs if node.op in _CARRIED]
    return None


def cache_io(graph: gs.Graph) -> dict[str, tuple[gs.Tensor, gs.Tensor | None]]:
    """The cache's canonical names (`past_key_values.N.key|value`) → (its graph input, its present output
    or None), read from the exporter's names where every cache input has the canonical one, else by
    structure; empty when the graph has no cache or its structure does not say which input is which."""
    candidates = {id(t): (t, concat) for t in graph.inputs if (concat := _appended(t)) is not None}
    if not candidates:
        return {}
    if all(PAST_NAME.match(t.name) for t, _ in candidates.values()):
        return {t.name: (t, _present(concat, graph.outputs)) for t, concat in candidates.values()}
    order = {id(node): index for index, node in enumerate(graph.nodes)}
    attentions: dict[int, dict[str, tuple[gs.Tensor, gs.Tensor | None]]] = {}
    for tensor, concat in candidates.values():
        found = _cache_kind(concat)
        if found is None or found[1] in attentions.setdefault(id(found[0]), {}):
            return {}
        attentions[id(found[0])][found[1]] = (tensor, _present(concat, graph.outputs))
    if any(len(caches) != 2 for caches in attentions.values()):
        return {}  # a key without the value of its attention, or the other way round
    named = {}
    for layer, node in enumerate(sorted(attentions, key=lambda node: order.get(node, -1))):
        for kind, cache in attentions[node].items():
            named[f"past_key_values.{layer}.{kind}"] = cache
    return named


class NameCausalLmIo:
    """Renames a causal LM's token inputs and logits output to the names the runtime reads."""

    name = "CausalLmIoNamingPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        taken = set(graph.tensors())
        renamed: dict[str, str] = {}

        def rename(tensor: gs.Tensor, name: str) -> None:
            if name in taken:
                return
            renamed[tensor.name] = name
            taken.discard(tensor.name)
            tensor.name = name
            taken.add(name)

        for tensor in list(graph.inputs):
            match = _SUFFIX.match(tensor.name)
            if match and match.group(1) in TOKEN_INPUT_NAMES:
                rename(tensor, match.group(1))
        ids = token_input(graph)
        vocab = _table_rows(ids) if ids is not None else None
        if ids is not None and ids.name != "input_ids":
            rename(ids, "input_ids")
        if "logits" not in {t.name for t in graph.outputs} and vocab is not None:
            floats = [t for t in graph.outputs if _rank(t) == 3 and dtype_kind(t.dtype) in "fV" and t.shape[-1] == vocab]
            if len(floats) == 1:
                rename(floats[0], "logits")
        cache = cache_io(graph)
        for name, (past, _) in cache.items():
            if past.name != name:
                rename(past, name)
        for name, (past, present) in cache.items():
            if present is not None and past.name == name and present.name != present_name(name):
                rename(present, present_name(name))
        for old, new in renamed.items():
            log.info("%s: the graph's %s is read as %s", self.name, old, new)
        return PassResult(match_times=len(renamed), effect_times=len(renamed))

