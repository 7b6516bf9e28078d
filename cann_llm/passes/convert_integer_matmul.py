"""IntegerMatMulConversionPass: onnxruntime's dynamically quantized matmuls → MatMul on QDQ operands.

`onnxruntime.quantization.quantize_dynamic` (and Optimum's ORTQuantizer in its dynamic, `is_static=False`
configurations, which calls it) writes each constant-weight MatMul as
`Mul(Cast(MatMulInteger(DynamicQuantizeLinear(x), Wq)), x_scale · w_scale)`; a session saved after
onnxruntime's optimizations writes the same as `com.microsoft.MatMulIntegerToFloat` (after a
DynamicQuantizeLinear) or `com.microsoft.DynamicQuantizeMatMul`. Each becomes, in standard ops,

    MatMul(DequantizeLinear(DynamicQuantizeLinear(x)), DequantizeLinear(Wq, w_scale, w_zero_point, axis=1))

(+ the bias, if the op had one): the same arithmetic up to float rounding, in the form every later pass
reads. The weight is a QDQ weight, merged by the projection fusions and repacked as it is by
WeightQuantizationPass; the activations' DequantizeLinear(DynamicQuantizeLinear(·)) tells that pass the
model quantizes them at run time, so the merged matmul runs on int8 activations (per block of K, finer than
the source's one scale a tensor). One DequantizeLinear is written per DynamicQuantizeLinear, so the
projections that shared an activation still share one input. Taken: 2-D int8/uint8 constant weights (or
the Transpose of one: a tied lm_head's) with one scale (and zero point) for the tensor or for each of its N
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import transposed_constant
from cann_llm.passes.pattern import FusionPass, other_input, producer, sole_consumer
from cann_llm.passes.rotary_tables import NodeBuilder
from cann_llm.passes.weight_memory import Deferred

DYNAMIC_QUANTIZE = "DynamicQuantizeLinear"
_MICROSOFT = "com.microsoft"
_WEIGHT_TYPES = ("int8", "uint8")


@dataclass
class IntegerMatMul:
    x: gs.Tensor  # the float activations, before their DynamicQuantizeLinear where there is one
    quantize: gs.Node | None  # that DynamicQuantizeLinear (None for DynamicQuantizeMatMul, which holds its own)
    weight: gs.Constant
    scale: np.ndarray  # [N] float32
    zero_point: np.ndarray | None  # [N], the weight's dtype; None when every one is 0
    bias: gs.Tensor | None
    output: gs.Tensor


@dataclass
class ActivationProduct:
    x: gs.Tensor  # both operands' float values, before their DynamicQuantizeLinear
    y: gs.Tensor
    bias: gs.Tensor | None
    output: gs.Tensor


def _optional(node: gs.Node, index: int) -> gs.Tensor | None:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index].name else None


def _per_column(tensor: gs.Tensor | None, n: int, dtype) -> np.ndarray | str | None:
    """A constant scale or zero point (one for the tensor, or one a column) as [N] of `dtype`; None when
    absent; a reason when it is neither."""
    if tensor is None:
        return None
    if not isinstance(tensor, gs.Constant):
        return "a weight's scale or zero point is not a constant"
    values = np.asarray(tensor.values).reshape(-1)
    if values.size not in (1, n):
        return f"a weight's scale or zero point has {values.size} values, neither one nor one a column ({n})"
    return np.broadcast_to(values, (n,)).astype(dtype)


def _transposed_table(weight: gs.Tensor) -> gs.Constant | None:
    """Eᵀ as a constant of its own, computed when read, when `weight` is the Transpose of a constant matrix E:
    a lm_head tied to the embedding, whose quantized table the lookup also reads (left unfolded when large,
    and the folding comes after this pass)."""
    table = transposed_constant(weight)
    if table is None:
        return None
    values = table._values if isinstance(table._values, Deferred) else table.values
    return gs.Constant(f"{weight.name}_transposed", Deferred(tuple(table.shape)[::-1], np.dtype(table.dtype),
                                                               lambda: np.ascontiguousarray(np.asarray(values).T)))


def _quantized_activation(a: gs.Tensor, scale: gs.Tensor | None, zero_point: gs.Tensor | None) -> gs.Node | None:
    """The DynamicQuantizeLinear whose outputs `a` (and, where given, `scale` and `zero_point`) are."""
    quantize = producer(a, DYNAMIC_QUANTIZE)
    if quantize is None or quantize.outputs[0] is not a or len(quantize.outputs) != 3:
        return None
    if zero_point is not None and zero_point is not quantize.outputs[2]:
        return None
    if scale is not None and scale is not quantize.outputs[1]:
        return None
    return quantize


class ConvertIntegerMatMul(FusionPass):
    """Write onnxruntime's dynamic-quantization matmuls as MatMuls of DequantizeLinear operands."""

    name = "IntegerMatMulConversionPass"
    anchor = ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")

    def match(self, graph: gs.Graph, node: gs.Node) -> IntegerMatMul | ActivationProduct | str:
        if node.op == "MatMulInteger":
            return self._matmul_integer(graph, node)
        if node.domain != _MICROSOFT:
            return f"not {_MICROSOFT}'s {node.op}"
        if node.op == "MatMulIntegerToFloat":
            # A, B, a_scale, b_scale, a_zero_point, b_zero_point, bias
            quantize = _quantized_activation(node.inputs[0], node.inputs[2], _optional(node, 4))
            if quantize is None or _optional(node, 4) is None:
                return "its activations are not a DynamicQuantizeLinear's, zero point included"
            other = _quantized_activation(node.inputs[1], node.inputs[3], _optional(node, 5))
            if other is not None and _optional(node, 5) is not None:
                return ActivationProduct(quantize.inputs[0], other.inputs[0], _optional(node, 6), node.outputs[0])
            return self._weight(quantize.inputs[0], quantize, node.inputs[1], node.inputs[3], _optional(node, 5),
                                _optional(node, 6), node.outputs[0])
        # DynamicQuantizeMatMul: A (float), B, b_scale, b_zero_point, bias
        return self._weight(node.inputs[0], None, node.inputs[1], node.inputs[2], _optional(node, 3),
                            _optional(node, 4), node.outputs[0])

    def _matmul_integer(self, graph: gs.Graph, node: gs.Node) -> IntegerMatMul | ActivationProduct | str:
        # quantize_dynamic's spelling: Mul(Cast(MatMulInteger(xq, Wq, x_zp, w_zp), float), Mul(x_scale, w_scale))
        quantize = _quantized_activation(node.inputs[0], None, _optional(node, 2))
        if quantize is None or _optional(node, 2) is None:
            return "its activations are not a DynamicQuantizeLinear's, zero point included"
        cast = sole_consumer(graph, node.outputs[0], "Cast")
        if cast is None or cast.attrs.get("to") != onnx.TensorProto.FLOAT:
            return "its product is not cast to float"
        scaled = sole_consumer(graph, cast.outputs[0], "Mul")
        scales = producer(other_input(scaled, cast.outputs[0]), "Mul") if scaled is not None else None
        if scales is None or not any(t is quantize.outputs[1] for t in scales.inputs):
            return "its product is not scaled by the activations' scale times the weight's"
        other_scale = other_input(scales, quantize.outputs[1])
        other = _quantized_activation(node.inputs[1], other_scale, _optional(node, 3))
        if other is not None and _optional(node, 3) is not None:
            return ActivationProduct(quantize.inputs[0], other.inputs[0], None, scaled.outputs[0])
        return self._weight(quantize.inputs[0], quantize, node.inputs[1], other_scale, _optional(node, 3), None,
                            scaled.outputs[0])

    def _weight(self, x: gs.Tensor, quantize: gs.Node | None, weight: gs.Tensor, scale: gs.Tensor | None,
                zero_point: gs.Tensor | None, bias: gs.Tensor | None, output: gs.Tensor) -> IntegerMatMul | str:
        weight = _transposed_table(weight) or weight
        if not isinstance(weight, gs.Constant) or len(weight.shape) != 2:
            return "the weight is not a constant matrix"
        kind = np.dtype(weight.dtype)
        if kind.name not in _WEIGHT_TYPES:
            return f"{kind.name} weights (taken: {', '.join(_WEIGHT_TYPES)})"
        n = int(weight.shape[1])
        scales = _per_column(scale, n, np.float32)
        if scales is None:
            return "the weight has no scale"
        zero_points = _per_column(zero_point, n, kind)
        for found in (scales, zero_points):
            if isinstance(found, str):
                return found
        if zero_points is not None and not np.any(zero_points):
            zero_points = None
        return IntegerMatMul(x, quantize, weight, scales, zero_points, bias, output)

    def rewrite(self, graph: gs.Graph, match: IntegerMatMul | ActivationProduct) -> None:
        name = match.output.name
        build = NodeBuilder(graph, name)
        match.output.inputs.clear()
        product = match.output if match.bias is None else gs.Variable(f"{name}/product", dtype=np.float32)
        if match.bias is not None:
            build("Add", [product, match.bias], output=match.output)
        if isinstance(match, ActivationProduct):
            # no kernel here multiplies two int8 activations (the attention's scores and context, a rotary's
            # angles: Optimum quantizes every MatMul): the product is the float one, as the fused attention
            # computes it
            build("MatMul", [match.x, match.y], output=product)
            return
        operands = [match.weight, build.const(match.scale, np.float32)]
        if match.zero_point is not None:
            operands.append(build.const(match.zero_point, match.zero_point.dtype))
        weight = build("DequantizeLinear", operands, {"axis": 1}, dtype=np.float32)
        build("MatMul", [self._activations(graph, match), weight], output=product)

    def _activations(self, graph: gs.Graph, match: IntegerMatMul) -> gs.Tensor:
        """The float activations the MatMul reads: the DynamicQuantizeLinear's values dequantized, one tensor
        for every matmul of the same activations, so that the projection fusions see one input (a
        DynamicQuantizeMatMul quantizes its own: the first of a tensor's writes a DynamicQuantizeLinear)."""
        quantize = match.quantize or next((r for r in match.x.outputs if r.op == DYNAMIC_QUANTIZE), None)
        if quantize is None:
            name = f"{match.x.name}/{DYNAMIC_QUANTIZE}"
            quantize = gs.Node(DYNAMIC_QUANTIZE, name=name, inputs=[match.x],
                               outputs=[gs.Variable(f"{name}/{part}", dtype=dtype) for part, dtype in
                                        (("quantized", np.uint8), ("scale", np.float32), ("zero_point", np.uint8))])
            graph.nodes.append(quantize)
        parts = list(quantize.outputs)
        existing = next((reader for reader in parts[0].outputs if reader.op == "DequantizeLinear"
                         and len(reader.inputs) == 3 and all(a is b for a, b in zip(reader.inputs, parts))), None)
        if existing is not None:
            return existing.outputs[0]
        return NodeBuilder(graph, parts[0].name)("DequantizeLinear", parts, dtype=np.float32)
