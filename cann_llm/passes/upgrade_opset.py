"""Raise a graph's default-domain opset with onnx's version converter (blocked INT4 DequantizeLinear
needs opset 21; the cann ops' lowerings write opset-13 forms). The converter runs on the light model, so
weights are neither copied nor serialised."""

from __future__ import annotations

import onnx_graphsurgeon as gs
from onnx import version_converter

from cann_llm.passes.graph_utils import light_model, replace_all_uses, tidy


def upgrade_opset(graph: gs.Graph, version: int) -> gs.Graph:
    """A graph computing the same function at default-domain opset `version` (never lowers it)."""
    if graph.opset >= version:
        return graph
    model, weights = light_model(graph)
    converted = gs.import_onnx(version_converter.convert_version(model, version))
    tensors = converted.tensors()
    for name, constant in weights.items():
        variable = tensors[name]
        converted.inputs.remove(variable)
        replace_all_uses(converted, variable, constant)
    return tidy(converted)
