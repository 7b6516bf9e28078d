"""Lower `cann` ops onto onnxruntime's kernels (contrib and standard) before a session is built.

Each lowering maps one node to nodes onnxruntime executes with the same semantics (docs/ops.md); ops
without one stay for the host kernels. The artifact keeps the `cann` ops: the lowering is the runtime's
choice, made at load, and the reference backend runs the numpy kernels instead.
"""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import helper

from runtime.kernels import CUSTOM_DOMAIN

MICROSOFT_DOMAIN = "com.microsoft"


def _attr(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _rms_norm(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    # ORT registers SimplifiedLayerNormalization in the default domain; stash_type=1 computes in float32
    return [helper.make_node("SimplifiedLayerNormalization", list(node.input), list(node.output), name=node.name,
                             axis=-1, epsilon=_attr(node, "epsilon", 1e-6), stash_type=1)]


def _add_rms_norm(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    y, total = (list(node.output) + [""])[:2]
    return [helper.make_node("SkipSimplifiedLayerNormalization", list(node.input), [y, "", "", total],
                             name=node.name, domain=MICROSOFT_DOMAIN, epsilon=_attr(node, "epsilon", 1e-6))]


def _swiglu(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    x, y = node.input[0], node.output[0]
    gate, up, sig, silu = (f"{node.name}/{part}" for part in ("gate", "up", "sigmoid", "silu"))
    # equal halves: implicit before opset 18, spelled with num_outputs from 18 on
    halves = {"num_outputs": 2} if opset >= 18 else {}
    return [helper.make_node("Split", [x], [gate, up], name=f"{node.name}/Split", axis=-1, **halves),
            helper.make_node("Sigmoid", [gate], [sig], name=f"{node.name}/Sigmoid"),
            helper.make_node("Mul", [gate, sig], [silu], name=f"{node.name}/MulSilu"),
            helper.make_node("Mul", [silu, up], [y], name=f"{node.name}/MulUp")]


LOWERINGS: dict[str, Callable[[onnx.NodeProto, int], list[onnx.NodeProto]]] = {
    "RmsNorm": _rms_norm,
    "AddRmsNorm": _add_rms_norm,
    "SwiGlu": _swiglu,
}


def lower_for_onnxruntime(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every lowerable `cann` node replaced; `model` itself is left alone."""
    if not any(n.domain == CUSTOM_DOMAIN for n in model.graph.node):
        return model
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    opset = next(o.version for o in lowered.opset_import if o.domain in ("", "ai.onnx"))
    nodes = []
    for node in lowered.graph.node:
        rule = LOWERINGS.get(node.op_type) if node.domain == CUSTOM_DOMAIN else None
        nodes.extend(rule(node, opset) if rule else [node])
    del lowered.graph.node[:]
    lowered.graph.node.extend(nodes)
    domains = {o.domain for o in lowered.opset_import}
    if MICROSOFT_DOMAIN not in domains:
        lowered.opset_import.append(helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    return lowered
