"""Side-by-side merging of MatMul weights [K, N1] … [K, Nm] → [K, N1 + … + Nm] for the projection fusions.

A weight is either a float constant or a DequantizeLinear of constant integers (a QDQ model): the merged
weight keeps that form (integers, scales and zero points concatenated along N), so quantized models
merge like float ones and the quantization pass later packs the merged matrix as it would a float one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.graph_utils import packed_constant
from passes.pattern import producer
from passes.weight_memory import Deferred, concatenated

_SUB_BYTE = ("int4", "uint4")


@dataclass
class WeightSource:
    """A mergeable weight: the float matrix, or the parts of its DequantizeLinear."""

    constant: gs.Constant | None = None
    dequantize: gs.Node | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        source = self.constant if self.constant is not None else self.dequantize.inputs[0]
        return tuple(source.shape)

    def key(self) -> tuple:
        """What must agree between weights merged together."""
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
