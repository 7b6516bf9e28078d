"""`compute_in_float32(graph)`: a graph that computes in float16 or bfloat16, rewritten to compute in float32.

transformers 5 loads a checkpoint in the dtype it was saved in (`dtype="auto"`), so a model exported the way
users load it computes in bfloat16 (Llama, Qwen, Gemma, SmolLM2) or float16; onnxruntime's CPU kernels lack
most bfloat16 ops (it refuses such a graph at load), and the cann ops' kernels compute in float32. As
ATC's `force_fp32` and llama.cpp's CPU backend do, the arithmetic is raised to float32: every float16 or
bfloat16 weight, constant, value, graph input and output becomes float32, and a Cast to either type a Cast
to float32, which the canonical passes then drop where it casts nothing. The graph is then the one a
float32 export of the same weights would have been, so every fusion reads it; the weights' storage is
`--precision_mode`'s choice (cann_llm/passes/precision_config.py: must_keep_origin_dtype keeps the dtype most of
the weights were in).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from cann_llm.passes.weight_memory import Deferred
from cann_llm.runtime.artifact import EXTERNAL_MIN_BYTES

LOW_TYPES = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
_LOW_DTYPES = {np.dtype(np.float16): "float16", np.dtype(ml_dtypes.bfloat16): "bfloat16"}
# the int attributes that name an element type: Cast's `to`, `dtype` (EyeLike, the Random ops),
# DequantizeLinear's `output_dtype`, the window ops' `output_datatype`
_TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype", "output_datatype")
# ops whose type attribute is no arithmetic to raise: BitCast reinterprets the bits at that width
_KEPT_TYPES = ("BitCast",)


def _low(dtype) -> str | None:
    """"float16" or "bfloat16" for those dtypes (numpy, ml_dtypes or ONNX's enum), else None."""
    if dtype is None:
        return None
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return LOW_TYPES.get(dtype)
    try:
        return _LOW_DTYPES.get(np.dtype(dtype))
    except TypeError:  # graphsurgeon's types numpy cannot name (the float8s)
        return None


def _upcast(constant: gs.Constant) -> None:
    source = constant._values
    shape = tuple(source.shape)
    if int(np.prod(shape, dtype=np.int64)) * 4 < EXTERNAL_MIN_BYTES:
        constant.values = _read(source).astype(np.float32)
    else:  # a weight: converted when a pass or the writer reads it, never all of them held at once
        constant.values = Deferred(shape, np.float32, lambda: _read(source).astype(np.float32))
    constant.export_dtype = None  # written as the values' type, not a type recorded at import


def _read(source) -> np.ndarray:
    # from the proto directly: graphsurgeon's own read of a bfloat16 proto warns that numpy lacks the type
    return numpy_helper.to_array(source.tensor) if isinstance(source, LazyValues) else np.asarray(source)


def _type_attributes(node: gs.Node) -> tuple[str, ...]:
    """The names of `node`'s attributes that may give the element type it computes in."""
    return () if node.op in _KEPT_TYPES else _TYPE_ATTRIBUTES


def _graphs(graph: gs.Graph) -> list[gs.Graph]:
    return [graph, *graph.subgraphs(recursive=True)]


def low_precision_compute(graph: gs.Graph) -> str | None:
    """The low precision `graph` computes in ("float16" or "bfloat16"), or None: a value of that type, a Cast
    or typed constant making one, or such a weight read by an op other than a Cast (weights only stored in
    it and cast up before use are computed in float32 already)."""
    for g in _graphs(graph):
        for tensor in g.tensors().values():
            if isinstance(tensor, gs.Variable) and _low(tensor.dtype):
                return _low(tensor.dtype)
        for node in g.nodes:
            for name in _type_attributes(node):
                if _low(node.attrs.get(name)):
                    return _low(node.attrs[name])
            value = node.attrs.get("value")
            if isinstance(value, gs.Constant) and _low(value.dtype):
                return _low(value.dtype)
            if node.op != "Cast":
                for tensor in node.inputs:
                    if isinstance(tensor, gs.Constant) and _low(tensor.dtype):
                        return _low(tensor.dtype)
    return None


@dataclass(frozen=True)
class Raised:
    """What compute_in_float32 raised: the low precision the model computed in, and the one most of its
    weights' bytes were in (None: float32, as Falcon-RW's float32 weights beside its bfloat16 ALiBi term),
    which must_keep_origin_dtype stores them in again."""

    computed: str
    weights: str | None


def _weights_dtype(graph: gs.Graph) -> str | None:
    """The low precision most bytes of `graph`'s float weights are in, or None when float32 (or wider) holds most."""
    sizes: Counter = Counter()
    for g in _graphs(graph):
        for tensor in g.tensors().values():
            if not isinstance(tensor, gs.Constant):
                continue
            low = _low(tensor.dtype)
            if low is None and not (isinstance(tensor.dtype, np.dtype) and tensor.dtype.kind == "f"):
                continue
            sizes[low] += int(np.prod(tensor.shape, dtype=np.int64)) * (2 if low else tensor.dtype.itemsize)
    return max(sizes, key=sizes.__getitem__) if sizes else None


def compute_in_float32(graph: gs.Graph) -> Raised | None:
    """Rewrite `graph` (and its subgraphs) in place to compute in float32 if it computes in float16 or
    bfloat16; returns what it raised, or None when it changed nothing. Values keep their numbers: both types
    convert to float32 exactly."""
    computed = low_precision_compute(graph)
    if computed is None:
        return None
    raised = Raised(computed, _weights_dtype(graph))
    for g in _graphs(graph):
        for tensor in g.tensors().values():
            if isinstance(tensor, gs.Constant) and _low(tensor.dtype):
                _upcast(tensor)
            elif isinstance(tensor, gs.Variable) and _low(tensor.dtype):
                tensor.dtype = np.float32
        for node in g.nodes:
            for name in _type_attributes(node):
                if _low(node.attrs.get(name)):
                    node.attrs[name] = TensorProto.FLOAT
            value = node.attrs.get("value")
            if isinstance(value, gs.Constant) and _low(value.dtype):
                _upcast(value)
    return raised
