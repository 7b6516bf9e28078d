"""Side-by-side merging of projections x·W1 … x·Wm, W [K, N1] … [K, Nm], into x·[W1 | … | Wm] for the
projection fusions.

A weight is a float constant, a DequantizeLinear of constant integers (a QDQ model), or the packed weight
of a cann::MatMulInt4 (onnxruntime's MatMulNBits, converted at import). The merged one keeps that form:
integers, scales and zero points concatenated along N, so quantized models merge like float ones; the
quantization pass later packs a merged QDQ matrix as it would a float one, and a MatMulInt4's bytes,
stored a row of N at a time, are merged as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import packed_constant
from cann_llm.passes.pattern import producer
from cann_llm.passes.weight_memory import Deferred, concatenated
from cann_llm.runtime.ops import CUSTOM_DOMAIN, MATMUL_INT4, MatMulQuantInput

_SUB_BYTE = ("int4", "uint4")


@dataclass
class WeightSource:
    """A mergeable weight: the float matrix, the parts of its DequantizeLinear, or the MatMulInt4 that holds
    it packed."""

    constant: gs.Constant | None = None
    dequantize: gs.Node | None = None
    packed: gs.Node | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed is not None:
            return int(self.packed.attrs["K"]), int(self.packed.attrs["N"])
        source = self.constant if self.constant is not None else self.dequantize.inputs[0]
        return tuple(source.shape)

    def key(self) -> tuple:
        """What must agree between weights merged together."""
        if self.packed is not None:
            attrs = self.packed.attrs
            parts = self.packed.inputs[MatMulQuantInput.B:]
            return ("packed", self.shape[0], *(int(attrs[name]) for name in ("bits", "block_size", "accuracy_level")),
                    tuple((np.dtype(t.dtype).name, len(t.shape)) for t in parts))
        if self.constant is not None:
            return ("float", np.dtype(self.constant.dtype).name, self.shape[0])
        node = self.dequantize
        return ("qdq", np.dtype(node.inputs[0].dtype).name, self.shape[0], node.attrs.get("axis", 1),
                node.attrs.get("block_size", 0), len([t for t in node.inputs if t.name]))


def weight_source(tensor: gs.Tensor) -> WeightSource | None:
    """`tensor` as a mergeable 2-D weight, or None."""
    if isinstance(tensor, gs.Constant):
        return WeightSource(constant=tensor) if len(tensor.shape) == 2 else None
    node = producer(tensor, "DequantizeLinear")
    if node is None or len(node.outputs[0].outputs) != 1:
        return None
    parts = [t for t in node.inputs if t.name]
    if not all(isinstance(t, gs.Constant) for t in parts) or len(node.inputs[0].shape) != 2:
        return None
    if node.attrs.get("axis", 1) not in (0, 1, -1):
        return None
    return WeightSource(dequantize=node)


def _packed_source(node: gs.Node) -> WeightSource | None:
    """A cann::MatMulInt4 of constant weight, scales and zero points (no input scale) as a mergeable weight."""
    parts = node.inputs[MatMulQuantInput.B:]
    if node.domain != CUSTOM_DOMAIN or len(node.inputs) > MatMulQuantInput.ZERO_POINTS + 1:
        return None
    if not all(isinstance(t, gs.Constant) for t in parts):
        return None
    return WeightSource(packed=node)


def projection(tensor: gs.Tensor) -> tuple[gs.Tensor, WeightSource | None] | None:
    """(x, W) when a MatMul or a MatMulInt4 computes `tensor` = x·W, W None when it cannot be merged; else None."""
    node = producer(tensor, "MatMul", MATMUL_INT4.name)
    if node is None:
        return None
    return node.inputs[0], weight_source(node.inputs[1]) if node.op == "MatMul" else _packed_source(node)


def biased_projection(tensor: gs.Tensor) -> tuple[gs.Tensor, WeightSource | None, np.ndarray | None] | None:
    """(x, W, b) when `tensor` = x·W (+ b) with a constant b [N] (Qwen2's q, k and v, a Llama's MLP with
    `mlp_bias`), the product read only by the bias's Add; W None when it cannot be merged; else None."""
    bias, add = None, producer(tensor, "Add")
    if add is not None:
        constants = [t for t in add.inputs if isinstance(t, gs.Constant)]
        if len(constants) != 1 or constants[0].shape is None or len(constants[0].shape) != 1:
            return None
        bias = np.asarray(constants[0].values)
        tensor = next(t for t in add.inputs if not isinstance(t, gs.Constant))
        if len(tensor.outputs) != 1:
            return None
    found = projection(tensor)
    if found is None or (bias is not None and found[1] is not None and bias.shape[0] != found[1].shape[1]):
        return None
    return found[0], found[1], bias


def merged_biases(graph: gs.Graph, projected: gs.Tensor, biases: list[np.ndarray | None], widths: list[int],
                  name: str) -> gs.Tensor:
    """`projected` + [b1 | … | bm], a missing bias as zeros of its projection's width; `projected` itself when
    no part has a bias."""
    if all(b is None for b in biases):
        return projected
    dtype = next(b.dtype for b in biases if b is not None)
    values = np.concatenate([np.zeros(width, dtype) if b is None else b for b, width in zip(biases, widths)])
    biased = gs.Variable(f"{name}_bias", dtype=projected.dtype, shape=projected.shape)
    graph.nodes.append(gs.Node("Add", name=f"{name}/Add", inputs=[projected, gs.Constant(f"{name}_bias_values", values)],
                               outputs=[biased]))
    return biased


def _source(constant: gs.Constant):
    """What a merge reads: a deferred weight stays deferred, an array (often a view of the mapped file) as is."""
    return constant._values if isinstance(constant._values, Deferred) else np.asarray(constant.values)


def can_merge(sources: list[WeightSource | None]) -> bool:
    return all(s is not None for s in sources) and len({s.key() for s in sources}) == 1


def merge_weights(graph: gs.Graph, sources: list[WeightSource], name: str) -> gs.Tensor:
    """One [K, ΣN] weight tensor equal to the given weights side by side."""
    if sources[0].constant is not None:
        # computed when read: mapped weights merged all at once would hold the model's size again
        return gs.Constant(name, concatenated([_source(s.constant) for s in sources], axis=1))
    nodes = [s.dequantize for s in sources]
    axis = nodes[0].attrs.get("axis", 1)
    parts = []
    for index in range(len([t for t in nodes[0].inputs if t.name])):
        arrays = [np.asarray(n.inputs[index].values) for n in nodes]
        if index == 0 or axis == 0:  # integers [K, N]; blocked scales and zero points [K/block, N]
            merged = np.concatenate(arrays, axis=1)
        else:  # per-channel scales and zero points [N]
            merged = np.concatenate(arrays, axis=0)
        # not `{name}_scales`: the name of the packed weight's scales the quantization pass writes from it
        label = f"{name}/{('values', 'scales', 'zero_points')[index]}"
        parts.append(packed_constant(label, merged) if np.dtype(merged.dtype).name in _SUB_BYTE
                     else gs.Constant(label, merged))
    output = gs.Variable(name, dtype=nodes[0].outputs[0].dtype,
                         shape=[sources[0].shape[0], sum(s.shape[1] for s in sources)])
    graph.nodes.append(gs.Node("DequantizeLinear", name=f"{name}/DequantizeLinear", attrs=dict(nodes[0].attrs),
                               inputs=parts, outputs=[output]))
    return output


def merged_projection(graph: gs.Graph, x: gs.Tensor, sources: list[WeightSource], output: gs.Tensor, name: str,
                      weight_name: str) -> None:
    """Write `output` = x · [W1 | … | Wm] as one node `name`: a MatMul of the merged weight, or a MatMulInt4 of the
    packed ones, whose weights, scales and zero points are concatenated along N."""
    if sources[0].packed is None:
        graph.nodes.append(gs.Node("MatMul", name=name, inputs=[x, merge_weights(graph, sources, weight_name)],
                                   outputs=[output]))
        return
    nodes = [s.packed for s in sources]
    # each part's leading axis runs over N (the weight [N, blocks, bytes], scales and zero points [N, ·] or
    # flat), so the parts concatenate along it, computed when read
    parts = [gs.Constant(f"{weight_name}/{MatMulQuantInput(index).name.lower()}",
                         concatenated([_source(n.inputs[index]) for n in nodes], axis=0))
             for index in range(MatMulQuantInput.B, len(nodes[0].inputs))]
    attrs = dict(nodes[0].attrs, N=sum(int(n.attrs["N"]) for n in nodes))
    graph.nodes.append(gs.Node(MATMUL_INT4.name, name=name, domain=CUSTOM_DOMAIN, attrs=attrs, inputs=[x, *parts],
                               outputs=[output]))
