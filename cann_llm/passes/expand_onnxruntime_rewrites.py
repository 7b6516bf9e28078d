"""OnnxRuntimeRewriteExpansionPass: what onnxruntime's extended graph optimizations write → the standard
spelling the fusions read.

A graph saved by a session at ORT_ENABLE_EXTENDED (`optimized_model_filepath`; Optimum's O2 and above) has
the scale folded into the scores' MatMul (`FusedMatMul`), SiLU written as `QuickGelu`, and rotate_half's two
Slices merged into one Split (GatherSliceToSplitFusion); onnx's reference evaluator runs neither contrib op.
Each rewrite is exact:

- `FusedMatMul(A, B, alpha, transA, transB)` → `MatMul(Transpose?(A), Transpose?(B))`, times alpha when it
  is not 1 (each transpose swaps the last two axes); batch transposes (`transBatchA/B`) stay as they are;
- `QuickGelu(x, alpha)` → `x · Sigmoid(alpha · x)` (SiLU when alpha is 1);
- a Split of a 4-D tensor's last axis into two constant sizes, one of them negated (rotate_half) → two
  Slices;
- copies of one DequantizeLinear of a computed value (the same inputs and attributes), which its QDQ
  optimizations write so that each reader has its own (a quantized embedding's lookup read by the first
  norm's Pow and Div) → one, read by them all, as the fusions expect of one value. A weight's copies stay
  apart: a projection fusion merges only a weight its own MatMul alone reads (layers sharing weights).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import tidy
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.pattern import const_ints
from cann_llm.passes.rotary_tables import NodeBuilder
from cann_llm.runtime.ops import MICROSOFT_DOMAIN


def _swapped(build: NodeBuilder, tensor: gs.Tensor) -> gs.Tensor | None:
    """`tensor` with its last two axes swapped, or None when its rank is not known."""
    if tensor.shape is None or len(tensor.shape) < 2:
        return None
    rank = len(tensor.shape)
    return build("Transpose", [tensor], {"perm": list(range(rank - 2)) + [rank - 1, rank - 2]}, dtype=tensor.dtype)


def _dtype(node: gs.Node):
    """The numpy type of a node's float operands or result, where inference or the file gives one (onnxruntime
    saves its optimized graphs without the types of their values), else None."""
    for tensor in (*node.inputs, *node.outputs):
        if tensor.dtype is not None:
            return helper.tensor_dtype_to_np_dtype(tensor.dtype) if isinstance(tensor.dtype, int) else tensor.dtype
    return None


def expand_fused_matmul(graph: gs.Graph, node: gs.Node) -> str | None:
    """The rewrite above, or why not."""
    if node.attrs.get("transBatchA", 0) or node.attrs.get("transBatchB", 0):
        return "a batch transpose"
    alpha, dtype = float(node.attrs.get("alpha", 1.0)), _dtype(node)
    if alpha != 1.0 and dtype is None:
        return "alpha's type is not known"
    build = NodeBuilder(graph, node.name or node.outputs[0].name)
    operands = []
    for tensor, flag in zip(node.inputs[:2], ("transA", "transB")):
        operands.append(_swapped(build, tensor) if node.attrs.get(flag, 0) else tensor)
        if operands[-1] is None:
            return f"{flag} on an operand of unknown rank"
    output = node.outputs[0]
    node.outputs.clear()
    if alpha == 1.0:
        build("MatMul", operands, output=output)
    else:
        product = build("MatMul", operands, dtype=output.dtype)
        build("Mul", [product, gs.Constant(f"{output.name}_alpha", np.array(alpha, dtype))], output=output)
    return None


def expand_quick_gelu(graph: gs.Graph, node: gs.Node) -> str | None:
    """The rewrite above, or why not."""
    x, output, alpha, dtype = node.inputs[0], node.outputs[0], float(node.attrs.get("alpha", 1.702)), _dtype(node)
    if alpha != 1.0 and dtype is None:
        return "alpha's type is not known"
    build = NodeBuilder(graph, node.name or output.name)
    node.outputs.clear()
    scaled = x if alpha == 1.0 else build("Mul", [x, gs.Constant(f"{output.name}_alpha", np.array(alpha, dtype))],
                                          dtype=x.dtype)
    build("Mul", [x, build("Sigmoid", [scaled], dtype=x.dtype)], output=output)
    return None


def split_halves_as_slices(graph: gs.Graph, node: gs.Node) -> str | None:
    """The Split rule above."""
    x = node.inputs[0]
    sizes = const_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None
    if x.shape is None or len(x.shape) != 4 or node.attrs.get("axis", 0) not in (-1, 3) or sizes is None \
            or len(sizes) != 2 or len(node.outputs) != 2:
        return "not two constant pieces of a 4-D tensor's last axis"
    if not any(reader.op == "Neg" for piece in node.outputs for reader in piece.outputs):
        return "no piece is negated (not rotate_half)"
    build = NodeBuilder(graph, node.name or node.outputs[0].name)
    pieces = list(node.outputs)
    node.outputs.clear()
    for piece, start, end in zip(pieces, (0, sizes[0]), sizes[:1] + [sizes[0] + sizes[1]]):
        build("Slice", [x, build.const([start]), build.const([end]), build.const([-1])], output=piece)
    return None


def shared_dequantizations(graph: gs.Graph) -> int:
    """The DequantizeLinear rule above; how many copies were dropped."""
    first: dict[tuple, gs.Node] = {}
    dropped = 0
    for node in [n for n in graph.nodes if n.op == "DequantizeLinear" and not n.domain and len(n.outputs) == 1
                 and not isinstance(n.inputs[0], gs.Constant)]:
        key = (tuple(id(t) for t in node.inputs), tuple(sorted((k, repr(v)) for k, v in node.attrs.items())))
        kept, copy = first.setdefault(key, node), node.outputs[0]
        if kept is node or any(t is copy for t in graph.outputs):
            continue
        for reader in list(copy.outputs):
            for index, tensor in enumerate(reader.inputs):
                if tensor is copy:
                    reader.inputs[index] = kept.outputs[0]
        dropped += 1
    return dropped


_CONTRIB = {"FusedMatMul": expand_fused_matmul, "QuickGelu": expand_quick_gelu}


class ExpandOnnxRuntimeRewrites:
    """Write what onnxruntime's extended optimizations wrote in the standard spelling."""

    name = "OnnxRuntimeRewriteExpansionPass"
    switchable = True

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        found = [(n, _CONTRIB[n.op]) for n in graph.nodes if n.domain == MICROSOFT_DOMAIN and n.op in _CONTRIB]
        found += [(n, split_halves_as_slices) for n in graph.nodes if n.op == "Split" and not n.domain]
        for node, rule in found:
            result.match_times += 1
            why = rule(graph, node)
            if why is None:
                result.effect_times += 1
            else:
                result.rejections.append(f"{node.name}: {why}")
        dropped = shared_dequantizations(graph)
        result.match_times += dropped
        result.effect_times += dropped
        tidy(graph)
        if result.effect_times:  # inference stopped at the contrib ops: what follows them gets its shapes now
            InferShapes().run(graph)
        return result
