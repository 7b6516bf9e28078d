"""AlibiBufferSplitPass: a constant holding ALiBi and the causal mask together, as Baichuan-13B's and
Baichuan2-13B's remote code builds it, split into the causal mask and an ALiBi term on each attention's
scores, the two spellings attention fusion reads.

    buffer[h, i, j] = m_h·j  (j <= i)      one [H, L, L] (or [1, H, L, L]) constant: `future_mask`
                      -inf   (j > i)

The remote code slices it to `[:H, :T, :T]` for T keys, adds it (its last row alone when one token is new,
`mask[:, -1:, :]`) to the padding mask it built, and adds that to every layer's scores. A mask holding
values per head is not one the fusion can drop, so it refused such attention. Here the buffer becomes its
causal part ([1, L, L]: 0 on and below the diagonal, the buffer's fill above), which the mask keeps, and
each attention whose mask reads it gets `scores + ramp[..., :T]` with ramp[h, j] = m_h·j, MPT's spelling
of the term (cann_llm/passes/match_alibi.py). The sum is unchanged value for value; a row's shift by a
constant would not change its softmax either. Only where everything reading the buffer is the mask of an
attention whose scores are found: anything else reading it would see other values.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses, tidy
from cann_llm.passes.match_alibi import line_slopes, rounding_tolerance
from cann_llm.passes.match_attention import MASKED_BELOW, computed_from, split_mask
from cann_llm.passes.pattern import axes_of, const_ints


def _alibi_buffer(tensor: gs.Constant) -> tuple[np.ndarray, np.ndarray] | None:
    """(the causal part [1, L, L] or [1, 1, L, L], the ramp [1, H, 1, L]) of a float [H, L, L] or [1, H, L, L] constant that is
    m_h·j (plus a constant a head) on and below the diagonal, the same in every row, and a masking value
    above it, with some slope not 0; else None."""
    shape = tuple(tensor.shape or ())
    if len(shape) not in (3, 4) or (len(shape) == 4 and shape[0] != 1) or shape[-1] != shape[-2] or shape[-1] < 2:
        return None
    values = np.asarray(tensor.values)
    if values.dtype.kind != "f":
        return None
    values = values.reshape(shape[-3:])
    if not (values[0, 0, 1] <= MASKED_BELOW < values[0, 1, 0]):  # a cheap look before reading it all
        return None
    length = shape[-1]
    seen = np.tril(np.ones((length, length), bool))
    rows = values[:, -1, :].astype(np.float64)  # the last row sees every key
    slopes = line_slopes(rows, values.dtype)
    if slopes is None or not np.any(slopes):
        return None
    # every row the last one's below the diagonal, to the rounding line_slopes allows
    tolerance = rounding_tolerance(rows, values.dtype)
    fill = values[0, 0, 1]
    for head in range(values.shape[0]):  # one head at a time: Baichuan2-13B's is [40, 4096, 4096]
        plane = values[head]
        if not (np.all(plane[~seen] <= MASKED_BELOW)
                and np.abs(plane - plane[-1])[seen].max() <= tolerance[head]):
            return None
    # of the buffer's rank, so that the axes its readers name stay the same
    causal = np.where(seen, 0, fill).astype(values.dtype).reshape((1,) * (len(shape) - 2) + (length, length))
    ramp = (rows - rows[:, :1]).astype(values.dtype)[None, :, None, :]
    return causal, ramp


def _reads_rows_and_keys_only(shape: gs.Node, rank: int, outputs: set[int]) -> bool:
    """Whether a Shape of a tensor of `rank` axes tells only its last two, the lengths the split keeps (the
    remote code's `src_len, tgt_len = alibi_mask.size()[-2:]`): from a start among them, or picked by Gathers
    or cut by a Slice from one; never where the whole shape is a graph output (`outputs`: their ids)."""
    last_two = (rank - 2, rank - 1, -2, -1)
    if shape.attrs.get("start", 0) in last_two:
        return True
    if id(shape.outputs[0]) in outputs or not shape.outputs[0].outputs:
        return False
    for reader in shape.outputs[0].outputs:
        if reader.op == "Gather" and reader.attrs.get("axis", 0) == 0:
            indices = const_ints(reader.inputs[1])
            if indices is None or any(i not in last_two for i in indices):
                return False
        elif reader.op == "Slice" and reader.inputs[0] is shape.outputs[0]:
            starts = const_ints(reader.inputs[1])
            if starts is None or starts[0] not in last_two:
                return False
        else:
            return False
    return True


_ON_THE_WAY = ("Slice", "Unsqueeze", "Expand", "Cast", "Add", "Max", "Where")


def _keeps_keys_and_heads(node: gs.Node, tensor: gs.Tensor, rank: int) -> str | None:
    """Why `node`, on the way from the buffer to a mask, would make the ramp's term differ from what it adds
    (None when it does not): anything but the ops of a mask, a new last axis, a slice of the keys with a
    step, or one of the heads that leaves some out."""
    if node.op not in _ON_THE_WAY:
        return f"computes the mask from it by {node.op}, which the split does not follow"
    if node.op == "Unsqueeze" and -1 in [a - len(node.outputs[0].shape or [0]) if a >= 0 else a for a in axes_of(node)]:
        return "moves its keys off the last axis"
    if node.op == "Slice" and node.inputs[0] is tensor:
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else None
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else [1] * len(axes or [])
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        here = len(tensor.shape or []) or rank
        if axes is None or steps is None:
            return "slices it along axes the split cannot read"
        for at, axis in enumerate(axes):
            axis %= here
            if axis == here - 1 and steps[at] != 1:
                return "slices its keys with a step"
            if axis == here - 3 and (starts is None or ends is None or starts[at] != 0 or steps[at] != 1
                                     or ends[at] < (tensor.shape or [0] * here)[axis]):
                return "slices its heads"
    return None


def _attention_adds(graph: gs.Graph, buffer: gs.Tensor) -> tuple[list[tuple[gs.Node, gs.Tensor]], list[gs.Tensor]] | str:
    """(the Add of scores and a mask reading `buffer`, those scores) for every attention whose mask reads it,
    and the masks' values computed from it, when nothing else reads it; else why not."""
    adds, mask_nodes = [], set()
    for softmax in (n for n in graph.nodes if n.op == "Softmax"):
        scores, masks, factor = split_mask(softmax.inputs[0])
        reading = [mask for mask in masks if any(buffer in node.inputs for node in computed_from(mask))]
        if not reading:
            continue
        add = next((n for n in scores.outputs if n.op == "Add" and any(m in n.inputs for m in reading)), None)
        if add is None or factor != 1.0:
            return f"{softmax.name}: its mask reads the buffer but is not added to its scores"
        adds.append((add, scores))
        mask_nodes |= {id(node) for mask in reading for node in computed_from(mask)}
    if not adds:
        return "no attention's mask reads it"
    ends, queue, computed = {id(add) for add, _ in adds}, [buffer], []
    while queue:
        tensor = queue.pop()
        for reader in tensor.outputs:
            if id(reader) in ends:
                continue
            if reader.op == "Shape":
                if not _reads_rows_and_keys_only(reader, len(tensor.shape or []) or len(buffer.shape),
                                                 {id(t) for t in graph.outputs}):
                    return f"{reader.name} reads its shape, whose heads the split changes"
                continue
            if id(reader) not in mask_nodes:
                return f"{reader.name} reads it and is no attention's mask"
            why = _keeps_keys_and_heads(reader, tensor, len(buffer.shape))
            if why:
                return f"{reader.name} {why}"
            queue.extend(reader.outputs)
            computed.extend(reader.outputs)
    outputs = {id(t) for t in graph.outputs}
    if any(id(t) in outputs for t in [buffer, *computed]):
        return "a graph output is computed from it"
    return adds, computed


class SplitAlibiBuffer:
    """ALiBi kept in one buffer with the causal mask → the causal mask, and ALiBi's term on the scores."""

    name = "AlibiBufferSplitPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        candidates = {id(t): t for node in graph.nodes if node.op == "Slice"
                      for t in node.inputs[:1] if isinstance(t, gs.Constant)}
        for buffer in candidates.values():
            split = _alibi_buffer(buffer)
            if split is None:
                continue
            result.match_times += 1
            found = _attention_adds(graph, buffer)
            if isinstance(found, str):
                result.rejections.append(f"{buffer.name}: {found}")
                continue
            adds, computed = found
            causal, ramp = split
            for tensor in computed:  # no longer one a head: inferred again
                tensor.shape = None
            replace_all_uses(graph, buffer, gs.Constant(f"{buffer.name}_causal", causal))
            ramp_part = gs.Constant(f"{buffer.name}_alibi", ramp)
            for index, (add, scores) in enumerate(adds):
                self._add_term(graph, add, scores, ramp_part, f"{buffer.name}/alibi_{index}")
            result.effect_times += 1
        if result.effect_times:
            tidy(graph)
        return result

    @staticmethod
    def _add_term(graph: gs.Graph, add: gs.Node, scores: gs.Tensor, ramp: gs.Constant, name: str) -> None:
        """`scores + ramp[..., :keys]` in place of `scores` in `add`, keys the scores' last axis."""
        shape, keys, term, biased = (gs.Variable(f"{name}_{part}", dtype=dtype) for part, dtype in (
            ("shape", np.int64), ("keys", np.int64), ("term", ramp.values.dtype), ("scores", scores.dtype)))
        graph.nodes += [
            gs.Node("Shape", f"{name}/Shape", inputs=[scores], outputs=[shape]),
            gs.Node("Gather", f"{name}/Keys", attrs={"axis": 0},
                    inputs=[shape, gs.Constant(f"{name}_last", np.array([-1], np.int64))], outputs=[keys]),
            gs.Node("Slice", f"{name}/Slice", outputs=[term], inputs=[
                ramp, gs.Constant(f"{name}_start", np.array([0], np.int64)), keys,
                gs.Constant(f"{name}_axis", np.array([-1], np.int64)), gs.Constant(f"{name}_step", np.array([1], np.int64))]),
            gs.Node("Add", f"{name}/Add", inputs=[scores, term], outputs=[biased]),
        ]
        add.inputs[add.inputs.index(scores)] = biased
