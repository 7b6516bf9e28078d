"""TableSliceRemovalPass: rows of a constant table gathered from the table itself, not from a slice of its
first rows.

Transformers before 4.38 kept the rotary tables as buffers of max_positions rows and wrote
`cos_cached[:seq_len][position_ids]`: a Slice of the first `seq_len` rows, its length read from a shape
(the past's plus the new tokens', or the new tokens' alone in a decoder without a cache), then a Gather by
the positions. The slice changes nothing the Gather reads (positions are at least 0 and, in any run the
export can make, under the length), but its length ties the table to the shapes: a paged compile, whose
batch is a flat run of tokens with no past input, would read one row for a one-token step. So
Gather(axis 0) of a Slice(table, 0, n) on axis 0 (through Casts) reads the table instead, and so does the
GatherND (no batch axes) that dynamo writes for the same indexing (transformers 4.44's Qwen2).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from passes.base import PassResult
from passes.graph_utils import replace_all_uses
from passes.pattern import const_ints


def _first_rows_of_a_table(node: gs.Node) -> gs.Constant | None:
    """The constant table a Slice cuts its first rows from (axis 0, from 0, step 1), else None."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    table, starts, _, axes, steps = inputs[:5]
    if not isinstance(table, gs.Constant) or const_ints(starts) != [0]:
        return None
    if axes is not None and axes.name and const_ints(axes) not in ([0], [-len(table.shape)]):
        return None
    if steps is not None and steps.name and const_ints(steps) != [1]:
        return None
    return table


def _gathers_rows(node: gs.Node, tensor: gs.Tensor) -> bool:
    """Whether `node` picks rows of `tensor` by index: a Gather on axis 0 (TorchScript's `table[positions]`), or
    a GatherND without batch axes (dynamo's), whose indices address axis 0 first."""
    if not node.inputs or node.inputs[0] is not tensor:
        return False
    if node.op == "Gather":
        return node.attrs.get("axis", 0) == 0
    return node.op == "GatherND" and node.attrs.get("batch_dims", 0) == 0


def _only_gathered(tensor: gs.Tensor) -> bool:
    """Whether `tensor` (through Casts) is only the data of row gathers (`_gathers_rows`)."""
    for reader in tensor.outputs:
        if reader.op == "Cast":
            if not _only_gathered(reader.outputs[0]):
                return False
        elif not _gathers_rows(reader, tensor):
            return False
    return bool(tensor.outputs)


class DropTableSlices:
    """Gathers of a constant table's first rows read the whole table."""

    name = "TableSliceRemovalPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for node in [n for n in graph.nodes if n.op == "Slice"]:
            table = _first_rows_of_a_table(node)
            if table is None or not _only_gathered(node.outputs[0]):
                continue
            result.match_times += 1
            replace_all_uses(graph, node.outputs[0], table)
            result.effect_times += 1
        if result.effect_times:
            graph.cleanup(remove_unused_graph_inputs=False)
        return result
