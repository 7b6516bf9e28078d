"""Which MatMuls quantize, and how: the constant 2-D float32 weights not named by a skip pattern (fnmatch on
node and weight names; `lm_head` = the MatMul producing the logits), at the configured bits, except an
INT4 model's lm_head, which takes `lm_head_bits`, and an MoE's routing weights (its router and a shared
expert's one-column gate), which stay float as vLLM and llama.cpp keep them: they choose the experts, and
are a tiny part of the bytes; and a DequantizeLinear weight (a QDQ model), which is repacked as it is
whether or not compression was asked for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import naming_patterns
from cann_llm.passes.pattern import producer
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.qdq_weight import QdqWeight, read_qdq_weight
from cann_llm.runtime.ops import MoEInput


@dataclass
class WeightChoice:
    """A MatMul chosen for quantization: its QDQ integers to repack, or (`qdq` None) its float weight to
    quantize, by the configured method or (`head_blocks`) as an INT4 model's 8-bit lm_head; `dynamic_input`:
    the float activations of a QDQ weight's MatMul whose model quantizes them at run time (onnxruntime's
    dynamic quantization, cann_llm/passes/convert_integer_matmul.py), which then runs on int8 activations."""

    matmul: gs.Node
    qdq: QdqWeight | None = None
    head_blocks: bool = False
    dynamic_input: gs.Tensor | None = None


def dynamically_quantized(activations: gs.Tensor) -> gs.Tensor | None:
    """`x` when `activations` = DequantizeLinear(DynamicQuantizeLinear(x)), else None."""
    dequantize = producer(activations, "DequantizeLinear")
    quantize = producer(dequantize.inputs[0], "DynamicQuantizeLinear") if dequantize is not None else None
    if quantize is None or len(dequantize.inputs) != 3 or not all(
            a is b for a, b in zip(dequantize.inputs, quantize.outputs)):
        return None
    return quantize.inputs[0]


def float_weight(weight: gs.Tensor) -> bool:
    """Whether `weight` is a constant 2-D float32 matrix, the only kind quantized."""
    return isinstance(weight, gs.Constant) and len(weight.shape) == 2 and np.dtype(weight.dtype) == np.float32


def lm_head_bits(config: QuantConfig) -> int:
    """The lm_head's bits when it is quantized: `lm_head_bits` in an INT4 model, 8 in an INT8 one."""
    return config.lm_head_bits if config.bits == 4 else 8


# what may stand between a router's logits and its TopK: a Softmax (TorchScript's with a Cast to float after
# it), a Sigmoid and a bias (DeepSeek-V3's scores), reshapes
_TO_THE_CHOICE = ("Softmax", "Sigmoid", "Cast", "Identity", "Reshape", "Add")


def routes_experts(matmul: gs.Node, head: gs.Node | None) -> bool:
    """Whether `matmul` computes an MoE's routing: the router logits (read by `cann::MoE`, or by the TopK of
    an unfused router, a few elementwise steps on), or a shared expert's one-column gate. Never the lm_head
    (a graph may sample its logits with a TopK)."""
    if matmul is head:
        return False
    weight = matmul.inputs[1]
    if weight.shape is not None and len(weight.shape) == 2 and weight.shape[1] == 1:
        return True
    values = [matmul.outputs[0]]
    for _ in range(4):
        readers = [(reader, value) for value in values for reader in value.outputs]
        if any(r.op == "TopK" or (r.op == "MoE" and r.inputs[MoEInput.ROUTER_LOGITS] is value) for r, value in readers):
            return True
        values = [out for r, _ in readers if r.op in _TO_THE_CHOICE for out in r.outputs]
    return False


def skip_patterns(config: QuantConfig, matmul: gs.Node, head: gs.Node | None) -> list[str]:
    """The skip patterns naming `matmul`."""
    return naming_patterns(matmul, matmul.inputs[1].name, head, config.skip_layers)


def choose_weight(config: QuantConfig | None, matmul: gs.Node, head: gs.Node | None,
                  matched_patterns: set[str]) -> WeightChoice | str:
    """How `matmul`'s weight quantizes, or why it does not; the skip patterns naming a float weight are
    added to `matched_patterns` (a pattern naming nothing is the user's mistake)."""
    weight = matmul.inputs[1]
    qdq = read_qdq_weight(weight)
    if qdq is not None:
        return qdq if isinstance(qdq, str) else WeightChoice(matmul, qdq=qdq,
                                                             dynamic_input=dynamically_quantized(matmul.inputs[0]))
    if config is None:
        return "weight compression is off"
    if not float_weight(weight):
        return "the weight is not a constant 2-D float32 matrix"
    patterns = skip_patterns(config, matmul, head)
    matched_patterns.update(patterns)
    if patterns:
        return f"skipped by pattern {patterns[0]!r}"
    if routes_experts(matmul, head):
        return "an MoE's routing weight: it stays float"
    return WeightChoice(matmul, head_blocks=matmul is head and config.bits == 4 and lm_head_bits(config) == 8)


def calibrated_inputs(graph: gs.Graph, config: QuantConfig, head: gs.Node | None) -> list[str]:
    """The MatMul inputs whose activations calibration measures: those of every weight that may quantize."""
    return sorted({n.inputs[0].name for n in graph.nodes if n.op == "MatMul" and len(n.inputs) == 2
                   and not skip_patterns(config, n, head) and not routes_experts(n, head)
                   and (float_weight(n.inputs[1]) or producer(n.inputs[1], "DequantizeLinear"))})
