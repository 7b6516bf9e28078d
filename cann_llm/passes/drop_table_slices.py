"""TableSliceRemovalPass: rows of a constant table gathered from the table itself, not from a slice of its
first rows.

Transformers before 4.38 kept the rotary tables as buffers of max_positions rows and wrote
`cos_cached[:seq_len][position_ids]`: a Slice of the first `seq_len` rows, its length read from a shape
(the past's plus the new tokens', or the new tokens' alone in a decoder without a cache), then a Gather by
the positions. The slice changes nothing the Gather reads (positions are at least 0 and, in any run the
export can make, under the length), but its length ties the table to the shapes: a paged compile, whose
batch is a flat run of tokens with no past input, would read one row for a one-token step. So
Gather(axis 0) of a Slice(table, 0, n) on axis 0 (through Casts) reads the table instead, and so does the
GatherND (no batch axes) that dynamo writes for the same indexing (transformers 4.44's Qwen2). The older
Llama lineage (Baichuan, InternLM) keeps `[1, 1, max_positions, dim]` buffers and writes
`cos_cached[:, :, :seq_len].squeeze(1).squeeze(0)[position_ids]`: a slice on the axis after unit axes that
Squeezes take away before the rows are gathered, read from the table the same way.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses
from cann_llm.passes.pattern import const_ints


def _first_rows_of_a_table(node: gs.Node) -> tuple[gs.Constant, int] | None:
    """(the constant table a Slice cuts its first rows from, the axis of those rows): from 0, step 1, on
    axis 0 or on an axis that only unit axes come before; else None."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    table, starts, _, axes, steps = inputs[:5]
    if not isinstance(table, gs.Constant) or const_ints(starts) != [0]:
        return None
    axis = 0
    if axes is not None and axes.name:
        sliced = const_ints(axes)
        if sliced is None or len(sliced) != 1:
            return None
        axis = sliced[0] % len(table.shape)
        if table.shape[axis] == 1 or any(size != 1 for size in table.shape[:axis]):
            return None
    if steps is not None and steps.name and const_ints(steps) != [1]:
        return None
    return table, axis


def _gathers_rows(node: gs.Node, tensor: gs.Tensor) -> bool:
    """Whether `node` picks rows of `tensor` by index: a Gather on axis 0 (TorchScript's `table[positions]`), or
    a GatherND without batch axes (dynamo's), whose indices address axis 0 first."""
    if not node.inputs or node.inputs[0] is not tensor:
        return False
    if node.op == "Gather":
        return node.attrs.get("axis", 0) == 0
    return node.op == "GatherND" and node.attrs.get("batch_dims", 0) == 0


def _only_gathered(tensor: gs.Tensor, row_axis: int = 0) -> bool:
    """Whether `tensor`, whose rows lie on `row_axis` after unit axes, is only the data of row gathers
    (`_gathers_rows`), through Casts and Squeezes that take away unit axes before the rows."""
    for reader in tensor.outputs:
        if reader.op == "Cast":
            if not _only_gathered(reader.outputs[0], row_axis):
                return False
        elif reader.op == "Squeeze" and row_axis > 0 and reader.inputs[0] is tensor:
            axes = const_ints(reader.inputs[1]) if len(reader.inputs) > 1 else reader.attrs.get("axes")
            # explicit axes before the rows: a Squeeze of every unit axis would take a single row's too
            if not axes or any(not 0 <= axis < row_axis for axis in axes):
                return False
            if not _only_gathered(reader.outputs[0], row_axis - len(set(axes))):
                return False
        elif row_axis != 0 or not _gathers_rows(reader, tensor):
            return False
    return bool(tensor.outputs)


class DropTableSlices:
    """Gathers of a constant table's first rows read the whole table."""

    name = "TableSliceRemovalPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for node in [n for n in graph.nodes if n.op == "Slice"]:
            found = _first_rows_of_a_table(node)
            if found is None or not _only_gathered(node.outputs[0], found[1]):
                continue
            result.match_times += 1
            replace_all_uses(graph, node.outputs[0], found[0])
            result.effect_times += 1
        if result.effect_times:
            graph.cleanup(remove_unused_graph_inputs=False)
        return result
