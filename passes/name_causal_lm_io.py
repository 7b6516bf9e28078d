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
    attention_mask, position_ids, input_ids
                    an input named so with TorchScript's `.N` suffix

A graph that already has a name, or where the choice is not unique, is left as it is.
"""

from __future__ import annotations

import logging
import re

import onnx_graphsurgeon as gs

from passes.base import PassResult
from passes.match_attention import dtype_kind

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
        for old, new in renamed.items():
            log.info("%s: the graph's %s is read as %s", self.name, old, new)
        return PassResult(match_times=len(renamed), effect_times=len(renamed))
