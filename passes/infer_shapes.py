"""ShapeInferencePass: give every intermediate value its dtype and (symbolic) shape.

onnx's inference serialises the model, and a protobuf cannot exceed 2 GiB, so it runs on a light copy
(`light_model`) in which large weights are graph inputs of the same type and shape.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from compiler.pass_manager import PassResult
from passes.graph_utils import light_model


def _dims(value: onnx.ValueInfoProto) -> list | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]


class InferShapes:
    """Annotate tensors with onnx's shape inference (data propagation on, strict off)."""

    name = "ShapeInferencePass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        inferred = onnx.shape_inference.infer_shapes(light_model(graph)[0], data_prop=True)
        found = {v.name: v for v in inferred.graph.value_info}
        found.update({v.name: v for v in inferred.graph.output})
        result = PassResult()
        for name, tensor in graph.tensors().items():
            value = found.get(name)
            if isinstance(tensor, gs.Constant) or value is None or not value.type.HasField("tensor_type"):
                continue
            result.match_times += 1
            elem_type = value.type.tensor_type.elem_type
            before = (tensor.dtype, tensor.shape)
            if elem_type:
                tensor.dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            dims = _dims(value)
            if dims is not None and (tensor.shape is None or _more_static(dims, tensor.shape)):
                tensor.shape = dims
            if (tensor.dtype, tensor.shape) != before:
                result.effect_times += 1
        return result


def _more_static(new: list, old) -> bool:
    """Take inferred dims only where they add information: more of them fixed to an int."""
    if len(new) != len(old):
        return True
    return sum(isinstance(d, int) for d in new) > sum(isinstance(d, int) for d in old)
