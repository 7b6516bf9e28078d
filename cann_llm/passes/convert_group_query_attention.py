"""GroupQueryAttentionConversionPass: com.microsoft.GroupQueryAttention → cann::FusedAttention.

GroupQueryAttention (reference/PEERS.md §4.2) states its mask by lengths: sequence b has
`seqlens_k[b] + 1` keys, the first ones of its cache, and its new tokens attend causally to them. Two
writers derive those lengths, and each maps onto FusedAttention's mask exactly:

    attention mask   seqlens_k = ReduceSum(M, 1) - 1, total_sequence_length = M's width, M a 2-D graph
                     input (the onnxruntime-genai builder): FusedAttention(attention_mask=M, causal=1), equal
                     on every token of a batch padded on the right (GQA's contract: its lengths count a
                     sequence's first keys); with one unpadded length per batch the caches are equal too
    position ids     seqlens_k = ReduceMax(position_ids, 1), total = ReduceMax(seqlens_k) + 1, position_ids a
                     graph input (onnxscript's GQA fusion, which drops the mask): causal=1, no mask, each
                     sequence's positions counting up from its past length, as that fusion assumes

Rotary embedding (`do_rotary`) reads `cos_cache`/`sin_cache` at the `position_ids` input, or at the
positions GroupQueryAttention derives from `seqlens_k` without one: the sequence's past length (0 for a
first prompt, when S equals total_sequence_length) plus the token's index. A paged compile takes those
positions from the runtime instead (`position_ids`, a new graph input), since the flattened batch has no
lengths to derive them from. `softcap` (Gemma 2) becomes FusedAttention's. Refused: a sliding window
(`local_window_size`), smooth softmax, head sinks, an attention bias, quantized caches, per-head q/k norms,
the qk output, causal=0, and lengths from anything else; past and present are separate buffers, not
onnxruntime-genai's shared one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import FusionPass, const_ints, fused_node, producer
from cann_llm.passes.rotary_tables import NodeBuilder, Rotation, rotary_tables
from cann_llm.runtime.ops import FUSED_ATTENTION, FusedAttentionInput, FusedAttentionOutput, input_at, positional

POSITIONS = "position_ids"
_UNSUPPORTED_INPUTS = {10: "an attention bias", 11: "head sinks", 12: "a k scale (quantized cache)",
                       13: "a v scale (quantized cache)", 14: "a per-head q norm", 15: "a per-head k norm"}


@dataclass
class GroupQueryAttentionMatch:
    node: gs.Node
    heads: int
    kv_heads: int
    head_dim: int
    mask: gs.Tensor | None
    rotation: Rotation | None
    derive_positions: bool


def _through(tensor: gs.Tensor, *ops: str) -> gs.Tensor:
    """`tensor` followed back through single-input `ops` (casts, reshapes)."""
    node = producer(tensor, *ops)
    while node is not None:
        tensor = node.inputs[0]
        node = producer(tensor, *ops)
    return tensor


def _reduced(tensor: gs.Tensor, op: str, axis: int) -> gs.Tensor | None:
    """x when `tensor` = op(x) over `axis` alone of a 2-D x, keepdims 0 (axes as attribute or input)."""
    node = producer(_through(tensor, "Cast"), op)
    if node is None or node.attrs.get("keepdims", 1) != 0:
        return None
    axes = node.attrs.get("axes") or (const_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None)
    source = _through(node.inputs[0], "Cast")
    rank = len(source.shape) if source.shape is not None else None
    if rank is None or axes is None or [a % rank for a in axes] != [axis % rank]:
        return None
    return source


def _minus_one(tensor: gs.Tensor, plus: bool = False) -> gs.Tensor | None:
    """x when `tensor` = x - 1 (or x + 1 with `plus`), up to casts."""
    node = producer(_through(tensor, "Cast"), "Add" if plus else "Sub")
    if node is None:
        return None
    operands = [node.inputs[0], node.inputs[1]] if not plus else sorted(node.inputs, key=lambda t: isinstance(t, gs.Constant))
    if const_ints(operands[1]) != [1]:
        return None
    return operands[0]


def _is_width_of(total: gs.Tensor, mask: gs.Tensor) -> bool:
    """Whether `total` is dim 1 of `mask`: Gather(Shape(M), 1), Shape(M)[1:2], or that number folded."""
    source = _through(total, "Cast", "Squeeze", "Reshape", "Unsqueeze")
    folded = const_ints(source)
    if folded is not None:
        return len(folded) == 1 and mask.shape is not None and folded[0] == mask.shape[1]
    gather = producer(source, "Gather")
    if gather is not None and gather.attrs.get("axis", 0) == 0 and const_ints(gather.inputs[1]) == [1]:
        shape = producer(gather.inputs[0], "Shape")
        return shape is not None and shape.inputs[0] is mask and shape.attrs.get("start", 0) == 0
    shape = producer(source, "Shape")
    return shape is not None and shape.inputs[0] is mask and (shape.attrs.get("start"), shape.attrs.get("end")) == (1, 2)


def length_source(graph: gs.Graph, seqlens_k: gs.Tensor, total: gs.Tensor) -> tuple[str, gs.Tensor] | str:
    """("mask", M) or ("positions", position_ids): the graph input the lengths come from, or why not."""
    inputs = {id(t) for t in graph.inputs}
    summed = _minus_one(seqlens_k)
    mask = _reduced(summed, "ReduceSum", 1) if summed is not None else None
    if mask is not None and id(mask) in inputs:
        if not _is_width_of(total, mask):
            return "total_sequence_length is not the attention mask's width"
        return "mask", mask
    positions = _reduced(seqlens_k, "ReduceMax", 1)
    if positions is not None and id(positions) in inputs:
        longest = _minus_one(total, plus=True)
        if longest is None or _reduced(longest, "ReduceMax", 0) is not _through(seqlens_k, "Cast"):
            return "total_sequence_length is not ReduceMax(seqlens_k) + 1"
        return "positions", positions
    return "seqlens_k is derived neither from a 2-D attention mask nor from position_ids graph inputs"


class ConvertGroupQueryAttention(FusionPass):
    """Bring onnxruntime's GroupQueryAttention into the cann op set."""

    name = "GroupQueryAttentionConversionPass"
    anchor = "GroupQueryAttention"

    def __init__(self, paged: bool = False):
        self.paged = paged

    def match(self, graph: gs.Graph, node: gs.Node) -> GroupQueryAttentionMatch | str:
        if node.domain != "com.microsoft":
            return "not com.microsoft's GroupQueryAttention"
        attrs = node.attrs
        for name, default, what in (("local_window_size", -1, "a sliding window (local_window_size)"),
                                    ("smooth_softmax", 0, "smooth softmax"),
                                    ("qk_output", 0, "the qk output"), ("causal", 1, "causal=0")):
            if attrs.get(name, default) != default:
                return f"{what} is not supported"
        for index, what in _UNSUPPORTED_INPUTS.items():
            if input_at(node.inputs, index) is not None:
                return f"{what} is not supported"
        if len(node.outputs) > 3 and node.outputs[3].name:
            return "the qk output is requested"
        if (input_at(node.inputs, 3) is None) != (input_at(node.inputs, 4) is None):
            return "a cache for only one of keys and values"
        if any(t is not None and t.dtype is not None and np.dtype(t.dtype) != np.float32
               for t in (input_at(node.inputs, 3), node.inputs[0])):
            return "not float32 (a quantized or half-precision cache)"
        heads, kv_heads = int(attrs.get("num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        query = node.inputs[0]
        width = query.shape[-1] if query.shape is not None and len(query.shape) == 3 else None
        packed = input_at(node.inputs, 1) is None
        if not isinstance(width, int) or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            return "the head counts or the query width are not static and compatible"
        head_dim = width // (heads + 2 * kv_heads) if packed else width // heads
        source = length_source(graph, node.inputs[5], node.inputs[6])
        if isinstance(source, str):
            return source
        kind, tensor = source
        rotation, derive = None, False
        if attrs.get("do_rotary", 0):
            cos, sin = input_at(node.inputs, 7), input_at(node.inputs, 8)
            if cos is None or sin is None or cos.shape is None or not isinstance(cos.shape[-1], int):
                return "do_rotary without cos_cache and sin_cache of a static width"
            positions = input_at(node.inputs, 9) or (tensor if kind == "positions" else None)
            derive = positions is None and not self.paged
            if positions is None and self.paged:
                positions = _positions_input(graph)
            rotation = Rotation(cos, sin, positions, 2 * cos.shape[-1], int(attrs.get("rotary_interleaved", 0)))
        return GroupQueryAttentionMatch(node, heads, kv_heads, head_dim, tensor if kind == "mask" else None,
                                        rotation, derive)

    def rewrite(self, graph: gs.Graph, match: GroupQueryAttentionMatch) -> None:
        node = match.node
        b = NodeBuilder(graph, node.name or "gqa")
        query = node.inputs[0]
        cos = sin = None
        if match.rotation is not None:
            if match.derive_positions:
                match.rotation.positions = _derived_positions(b, query, node.inputs[5], node.inputs[6])
            cos, sin = rotary_tables(b, match.rotation, query)
        # GroupQueryAttention's own slots (com.microsoft's spec): query, key, value, past_key, past_value, ...
        slot = FusedAttentionInput
        inputs = positional(slot, {
            slot.QUERY: query, slot.KEY: input_at(node.inputs, 1), slot.VALUE: input_at(node.inputs, 2),
            slot.PAST_KEY: input_at(node.inputs, 3), slot.PAST_VALUE: input_at(node.inputs, 4),
            slot.ATTENTION_MASK: match.mask, slot.COS: cos, slot.SIN: sin},
            gs.Variable.empty())
        # and its outputs: output, present_key, present_value
        outputs = positional(FusedAttentionOutput, {
            FusedAttentionOutput.OUTPUT: node.outputs[0], FusedAttentionOutput.PRESENT_KEY: input_at(node.outputs, 1),
            FusedAttentionOutput.PRESENT_VALUE: input_at(node.outputs, 2)}, gs.Variable.empty())
        scale = float(node.attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(match.head_dim))
        node.inputs.clear()
        graph.nodes.append(fused_node(
            FUSED_ATTENTION.name, inputs, outputs, f"{node.name}_{FUSED_ATTENTION.name}", num_heads=match.heads,
            kv_num_heads=match.kv_heads, head_dim=match.head_dim, scale=scale, causal=1,
            rotary_dim=match.rotation.rotary_dim if match.rotation else 0,
            rotary_interleaved=match.rotation.interleaved if match.rotation else 0, bias_per_head=0, bias_is_bool=0,
            **({"softcap": float(node.attrs["softcap"])} if node.attrs.get("softcap", 0.0) else {})))


def _positions_input(graph: gs.Graph) -> gs.Tensor:
    """The graph input `position_ids` [batch, sequence] int64, added the first time it is asked for."""
    found = next((t for t in graph.inputs if t.name == POSITIONS), None)
    if found is None:
        found = gs.Variable(POSITIONS, dtype=np.int64, shape=["batch_size", "sequence_length"])
        graph.inputs.append(found)
    return found


def _derived_positions(b: NodeBuilder, query: gs.Tensor, seqlens_k: gs.Tensor, total: gs.Tensor) -> gs.Tensor:
    """[B, S] positions as GroupQueryAttention derives them: past length + index, the past length being
    0 for a first prompt (S = total_sequence_length) and seqlens_k + 1 - S otherwise."""
    seq = b("Gather", [b("Shape", [query], dtype=np.int64), b.const([1])], {"axis": 0}, dtype=np.int64)  # [1]
    total64 = b("Reshape", [b("Cast", [total], {"to": 7}, dtype=np.int64), b.const([1])], dtype=np.int64)
    past = b("Sub", [b("Add", [b("Cast", [seqlens_k], {"to": 7}, dtype=np.int64), b.const([1])], dtype=np.int64), seq],
             dtype=np.int64)
    first = b("Equal", [seq, total64], dtype=np.bool_)
    past = b("Where", [first, b.const([0]), past], dtype=np.int64)  # [B]
    steps = b("Range", [b.const(0), b("Squeeze", [seq, b.const([0])], dtype=np.int64), b.const(1)], dtype=np.int64)
    return b("Add", [b("Unsqueeze", [past, b.const([1])], dtype=np.int64),
                     b("Unsqueeze", [steps, b.const([0])], dtype=np.int64)], dtype=np.int64)
