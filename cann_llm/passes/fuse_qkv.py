"""QkvFusionPass: one packed projection for FusedAttention's query, key and value.

Three MatMuls of the same input with constant (or QDQ) weights, each optionally plus a constant bias (as
in Qwen2 and InternLM), become one MatMul against [Wq | Wk | Wv] (plus [bq | bk | bv]): one GEMM reads
the activations once. Three MatMulInt4 of one layout (onnxruntime's MatMulNBits) become one likewise.
Where q and k reach the attention through per-head ops (Qwen3's q and k norms: a Reshape to heads, an
RmsNorm over each), the packed projection is split back into the three before them.
A projection already packed and cut by Slices or a Split (Phi-3's qkv_proj, Baichuan's W_pack) is fed to
the attention as it is. Runs after AttentionFusionPass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import split_into
from cann_llm.passes.merge_weights import WeightSource, biased_projection, can_merge, merged_biases, merged_projection
from cann_llm.passes.pattern import FusionPass, producer
from cann_llm.runtime.ops import CUSTOM_DOMAIN, FUSED_ATTENTION, input_at
from cann_llm.runtime.ops import FusedAttentionInput as Slot


# what may stand between a projection and the attention, each read only by the next
PER_HEAD_OPS = ("Reshape", "Transpose", "RmsNorm")


@dataclass
class QkvMatch:
    attention: gs.Node
    x: gs.Tensor | None
    weights: list[WeightSource]
    biases: list[np.ndarray | None]  # one a projection, None where it has none
    packed: gs.Tensor | None
    roots: list[gs.Tensor] | None = None  # the three projections' outputs, when per-head ops read them


def _linear(graph: gs.Graph, tensor: gs.Tensor) -> tuple[gs.Tensor, WeightSource, np.ndarray | None] | None:
    """(x, W, b) when `tensor` = x·W (+ b) with a constant (or QDQ) W [K, N] and b [N], read only by its
    attention."""
    if len(tensor.outputs) != 1 or any(t is tensor for t in graph.outputs):
        return None
    found = biased_projection(tensor)
    return found if found is not None and found[1] is not None else None


def _projected(graph: gs.Graph, tensor: gs.Tensor) -> tuple[gs.Tensor, tuple] | None:
    """(the projection's output, `_linear` of it) when `tensor` is a projection seen through PER_HEAD_OPS."""
    while (linear := _linear(graph, tensor)) is None:
        node = producer(tensor, *PER_HEAD_OPS)
        if node is None or len(tensor.outputs) != 1 or any(t is tensor for t in graph.outputs):
            return None
        tensor = node.inputs[0]
    return tensor, linear


def _packed_source(q: gs.Tensor, k: gs.Tensor, v: gs.Tensor) -> gs.Tensor | None:
    """The tensor q, k and v were cut from, in that order along the last axis, if they were."""
    nodes = [producer(t, "Slice", "Split") for t in (q, k, v)]
    if any(n is None for n in nodes):
        return None
    source = nodes[0].inputs[0]
    if nodes[0].op == "Split":
        axis = nodes[0].attrs.get("axis", 0)
        same = all(n is nodes[0] for n in nodes) and list(nodes[0].outputs) == [q, k, v]
        return source if same and axis in (-1, len(source.shape or []) - 1) else None
    offset = 0
    for node, part in zip(nodes, (q, k, v)):
        values = [np.asarray(t.values).reshape(-1) if isinstance(t, gs.Constant) else None for t in node.inputs[1:4]]
        if node.inputs[0] is not source or any(v is None or len(v) != 1 for v in values):
            return None
        start, end, axis = (int(v[0]) for v in values)
        width = part.shape[-1] if part.shape else None
        if start != offset or not isinstance(width, int) or axis not in (-1, len(source.shape or []) - 1):
            return None
        offset = start + width
    return source if source.shape and offset == source.shape[-1] else None


class FuseQkv(FusionPass):
    """Pack FusedAttention's three projections into one."""

    name = "QkvFusionPass"
    anchor = FUSED_ATTENTION.name

    def match(self, graph: gs.Graph, attention: gs.Node) -> QkvMatch | str:
        if attention.domain != CUSTOM_DOMAIN:
            return "not a cann::FusedAttention"
        if input_at(attention.inputs, Slot.KEY) is None:
            return "the projection is packed already"
        q, k, v = (attention.inputs[slot] for slot in (Slot.QUERY, Slot.KEY, Slot.VALUE))
        packed = _packed_source(q, k, v)
        if packed is not None:
            return QkvMatch(attention, None, [], [], packed)
        found, roots = [_linear(graph, t) for t in (q, k, v)], None
        if any(f is None for f in found):
            traced = [_projected(graph, t) for t in (q, k, v)]
            if any(t is None for t in traced):
                return "q, k and v are not all constant-weight MatMuls (+ bias) read only by this attention"
            roots, found = [t[0] for t in traced], [t[1] for t in traced]
        if not (found[0][0] is found[1][0] is found[2][0]):
            return "q, k and v project different inputs"
        weights = [f[1] for f in found]
        if not can_merge(weights):
            return "the projection weights differ in kind, dtype, input size or quantization"
        return QkvMatch(attention, found[0][0], weights, [f[2] for f in found], None, roots)

    def rewrite(self, graph: gs.Graph, match: QkvMatch) -> None:
        attention = match.attention
        packed = match.packed
        if packed is None:
            name = attention.name + "_qkv"
            width = sum(w.shape[1] for w in match.weights)
            shape = None if match.x.shape is None else list(match.x.shape[:-1]) + [width]
            packed = gs.Variable(f"{name}_matmul", dtype=attention.inputs[Slot.QUERY].dtype, shape=shape)
            merged_projection(graph, match.x, match.weights, packed, f"{name}/MatMul", f"{name}_weight")
            packed = merged_biases(graph, packed, match.biases, [w.shape[1] for w in match.weights], name)
            if match.roots is not None:
                split_into(graph, packed, [w.shape[1] for w in match.weights], match.roots, f"{name}/Split")
                return
        attention.inputs[Slot.QUERY] = packed
        attention.inputs[Slot.KEY] = gs.Variable.empty()
        attention.inputs[Slot.VALUE] = gs.Variable.empty()
