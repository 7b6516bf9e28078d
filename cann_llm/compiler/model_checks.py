"""What a model must satisfy before any pass sees it: onnx's checker with strict shape inference, shapes that
agree once their computations are followed, and the limits of what we can run. Each violation is E10041
naming the tensor, the opset or the node.

Limits, and why these numbers:
- ai.onnx opsets from 7 (the oldest onnxruntime loads) to the newest both onnx and onnxruntime know: an
  opset beyond them has no schema to check against and no kernel to run (opset 99 once compiled).
- rank at most 64: numpy's NPY_MAXDIMS, so a tensor of higher rank cannot even become an array.
- a dimension at most 2^31 - 1: no real model comes near it (vocabularies ~2^18, contexts ~2^20), and
  a few such dimensions multiplied for a size overflow int64, where a size check would then pass.
- no negative dimension: ONNX writes an unknown size as a named dim_param, never as a number.
- no string tensors as weights or inputs, and integer `input_ids`: no kernel of ours takes anything else.
- at most 64 subgraphs (`If` branches, `Loop` and `Scan` bodies) left once the `If`s on constant
  conditions took their branch (cann_llm/compiler/loader.py import_graph): shape inference and onnxruntime visit
  every one, and a model nesting `If`s on a run-time flag eight deep (254 branches, 3.3 MB) held a
  compile for 128 s; exports of LLMs have none, encoder-decoders' merged decoders two.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path

import onnx
import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from cann_llm.passes.infer_shapes import PROPAGATED_DIM
from cann_llm.runtime.artifact import SUB_BYTE_BITS
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import CUSTOM_DOMAIN
from cann_llm.runtime.proto_utils import graphs_within

MIN_OPSET = 7
MAX_RANK = 64
MAX_DIM = 2**31 - 1
MAX_SUBGRAPHS = 64
UNRUNNABLE_TYPES = {TensorProto.UNDEFINED: "undefined", TensorProto.STRING: "string"}
# ops whose `axis` attribute indexes the dimensions of their first input
AXIS_OPS = frozenset({"Concat", "Gather", "GatherElements", "Softmax", "LogSoftmax", "Hardmax", "Split", "ArgMax",
                      "ArgMin", "LayerNormalization", "Flatten"})
INTEGER_INPUTS = {"input_ids": (TensorProto.INT32, TensorProto.INT64)}


@lru_cache(maxsize=1)
def supported_opsets() -> dict[str, tuple[int, int]]:
    """{domain: (lowest, highest)} opset: the default domain's from 7 to onnx's newest, capped by the newest
    onnxruntime registers a CPU kernel for; onnxruntime's own domains (com.microsoft) as its CPU kernels
    have them; ours (`cann`) at 1, the version the compiler writes. A version outside them makes
    onnxruntime refuse the session (com.microsoft 24 once compiled and failed at load)."""
    from onnxruntime.capi import _pybind_state

    versions: dict[str, list[int]] = {}
    for kernel in _pybind_state.get_all_opkernel_def():
        if kernel.provider == "CPUExecutionProvider":
            versions.setdefault(kernel.domain or "ai.onnx", []).append(kernel.version_range[0])
    ranges = {domain: (min(found), max(found)) for domain, found in versions.items()}
    ranges["ai.onnx"] = (MIN_OPSET, min(onnx.defs.onnx_opset_version(), ranges["ai.onnx"][1]))
    ranges[CUSTOM_DOMAIN] = (1, 1)
    return ranges


def check_model(model: onnx.ModelProto, checked: onnx.ModelProto, path: Path) -> None:
    """Refuse `model` (as loaded, external data left on disk) with E10041 when it breaks a limit above or
    when `checked` (the form onnx's checker can read: initializers as inputs, onnxruntime's default-domain
    extras moved aside) fails `onnx.checker.check_model(full_check=True)`."""
    _check_opsets(model, path)
    _check_element_types(model.graph, path)
    _check_tensors(model.graph, path)
    # value_info holds an exporter's shape hints, which we infer again; onnxruntime-genai's builder writes
    # some that disagree with the ops (a scalar annotation on a [1] constant), and they change nothing run
    del checked.graph.value_info[:]
    try:
        onnx.checker.check_model(checked, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as error:
        # ValueError: what the checker's own type lookups raise on a field it did not validate first
        raise AtcError("E10041", path, reason=f"the ONNX checker refused the model: {str(error).strip()}") from None
    _check_axes(_shapes_that_agree(model, checked, path), path)


def _shapes_that_agree(model: onnx.ModelProto, checked: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """`checked` with onnx's inferred shapes; E10041 naming the node where they contradict each other once the
    values of the shape computations are followed (strict inference with data propagation, which the checker
    does not run). onnxruntime propagates them too and refuses such a graph at load, so a compile of it would
    only fail later (such graphs were seen from TorchScript traces of transformers 5's Cohere, Helium and
    ERNIE 4.5). Past PROPAGATED_DIM a fixed input dim would take the propagation gigabytes, and only shapes
    are inferred."""
    initializers = {t.name for t in model.graph.initializer}
    largest = max((d.dim_value for value in model.graph.input if value.name not in initializers
                   for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")), default=0)
    propagate = largest <= PROPAGATED_DIM
    followed = checked
    if propagate:
        # the shape computations' own constants (small integer initializers), which `checked` holds as inputs
        followed = onnx.ModelProto()
        followed.CopyFrom(checked)
        shapes = [t for t in model.graph.initializer if t.data_type in (TensorProto.INT64, TensorProto.INT32)
                  and math.prod(t.dims) <= MAX_RANK and not t.external_data]
        names = {t.name for t in shapes}
        kept = [value for value in followed.graph.input if value.name not in names]
        del followed.graph.input[:]
        followed.graph.input.extend(kept)
        followed.graph.initializer.extend(shapes)
    try:
        return onnx.shape_inference.infer_shapes(followed, strict_mode=propagate, data_prop=propagate)
    except onnx.shape_inference.InferenceError as error:
        text = " ".join(str(error).split())
        # a broadcast or matmul of sizes that cannot meet in the graph itself, which onnxruntime refuses too:
        # strict inference also fails on what onnxruntime loads (a merged decoder's If, whose branches' outputs
        # differ in shape, and the branches' nodes, which it sizes as if both ran)
        top = {node.name for node in model.graph.node}
        found = [(name, whole) for whole, name in re.findall(
            r"(\(op_type:[^)]*node name: ([^)]*)\): \[ShapeInferenceError\] Incompatible dimensions[^(]*)", text)
            if name in top]
        if found:
            raise AtcError("E10041", path, reason=f"the model's shapes contradict each other, which onnxruntime "
                                                  f"refuses at load: {found[0][1].strip()} (a TorchScript trace "
                                                  f"writes some models so: export them with the dynamo exporter)") from None
    return onnx.shape_inference.infer_shapes(checked)


def _check_axes(inferred: onnx.ModelProto, path: Path) -> None:
    """E10041 naming the node whose `axis` is outside its first input's rank (where inference knows it):
    onnx's shape inference reads the attribute as a 32-bit int, so an axis of 2^32 passes its check as 0,
    and onnxruntime then fails the first step, or constant folding retries it for minutes."""
    ranks = {info.name: len(info.type.tensor_type.shape.dim) for info in (*inferred.graph.input, *inferred.graph.value_info)
             if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape")}
    for node in inferred.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in AXIS_OPS or not node.input:
            continue
        rank = ranks.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        if rank is None or axis is None:
            continue
        high = rank if node.op_type == "Flatten" else rank - 1
        if not -rank <= axis <= high:
            raise AtcError("E10041", path, reason=f"node {node.name} ({node.op_type}) has axis {axis}; its input "
                                                  f"{node.input[0]} has rank {rank}, so the axis must be in "
                                                  f"[{-rank}, {high}]")


def _check_opsets(model: onnx.ModelProto, path: Path) -> None:
    ranges = supported_opsets()
    seen: set[str] = set()
    for opset in model.opset_import:
        domain = opset.domain or "ai.onnx"
        if domain in seen:
            raise AtcError("E10041", path, reason=f"the model imports {domain} twice")
        seen.add(domain)
        if domain in ranges and not ranges[domain][0] <= opset.version <= ranges[domain][1]:
            low, high = ranges[domain]
            raise AtcError("E10041", path, reason=f"the model imports {domain} opset {opset.version}; "
                                                  f"supported are opsets {low} to {high}")


def _check_element_types(graph: onnx.GraphProto, path: Path) -> None:
    """E10041 for an element type TensorProto.DataType does not name (99, or 0 in a Constant): onnx's
    checker and numpy's type lookups raise ValueError on one, before any check names it."""
    known = set(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}
    for g in graphs_within(graph):
        tensors = [*g.initializer]
        for node in g.node:
            for attribute in node.attribute:
                tensors.extend((attribute.t,) if attribute.HasField("t") else attribute.tensors)
        for tensor in tensors:
            if tensor.data_type not in known:
                raise AtcError("E10041", path, reason=f"tensor {tensor.name or '(a constant)'} has element type "
                                                      f"{tensor.data_type}, which ONNX does not define")
            _check_stored_size(tensor, path)
        for info in (*g.input, *g.output, *g.value_info):
            # an annotation's type may be left unset (0): inputs are held to UNRUNNABLE_TYPES below
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type not in known | {0}:
                raise AtcError("E10041", path, reason=f"tensor {info.name} has element type "
                                                      f"{info.type.tensor_type.elem_type}, which ONNX does not define")


def stored_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes a tensor's dims and element type make (sub-byte types packed), inline or external; None
    for strings and for a type numpy has no layout for (the 6-bit floats)."""
    if tensor.data_type == TensorProto.STRING:
        return None
    bits = SUB_BYTE_BITS.get(tensor.data_type)
    if bits is None:
        try:
            bits = 8 * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        except (KeyError, TypeError, ValueError):
            return None
    return -(-math.prod(tensor.dims) * bits // 8)  # Python ints: a product of hostile dims cannot wrap


def _check_stored_size(tensor: onnx.TensorProto, path: Path) -> None:
    """E10041 when an inline tensor's bytes (or values) are not what its dims and element type make: every
    reader after this one (graphsurgeon, numpy, onnxruntime) would fail or misread it. External data is
    held to `stored_bytes` where its file is checked (cann_llm/compiler/loader.py)."""
    if tensor.data_location == TensorProto.EXTERNAL or any(d < 0 for d in tensor.dims):
        return  # _check_tensors names a negative dimension
    expected = stored_bytes(tensor)
    if expected is None:
        return  # onnxruntime's checks decide
    name = tensor.name or "(a constant)"
    if tensor.HasField("raw_data"):
        stored = len(tensor.raw_data)  # a transient copy (protobuf's bytes), one tensor at a time
        if stored != expected:
            raise AtcError("E10041", path, reason=f"tensor {name} holds {stored} bytes; its dims "
                                                  f"{list(tensor.dims)} of {_type_name(tensor.data_type)} need {expected}")
        return
    if tensor.data_type in SUB_BYTE_BITS:
        return  # packed into int32_data two or more to a value
    try:
        values = len(getattr(tensor, helper.tensor_dtype_to_field(tensor.data_type)))
    except KeyError:
        return
    expected = math.prod(tensor.dims) * (2 if tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128) else 1)
    if values and values != expected:
        raise AtcError("E10041", path, reason=f"tensor {name} holds {values} values; its dims {list(tensor.dims)} "
                                              f"need {expected}")


def _type_name(data_type: int) -> str:
    return TensorProto.DataType.Name(data_type).lower()


def check_subgraphs(graph: gs.Graph, path: Path) -> None:
    """E10041 when `graph` (imported, its constant conditionals already replaced by their branch) has more
    than MAX_SUBGRAPHS subgraphs."""
    count = len(list(graph.subgraphs(recursive=True)))
    if count > MAX_SUBGRAPHS:
        raise AtcError("E10041", path, reason=f"the model has {count} subgraphs (If branches, Loop and Scan bodies) "
                                              f"on run-time conditions; at most {MAX_SUBGRAPHS} are supported")


def _check_tensors(graph: onnx.GraphProto, path: Path) -> None:
    for g in graphs_within(graph):
        for tensor in g.initializer:
            _check_dims(path, f"weight {tensor.name}", list(tensor.dims))
            if tensor.data_type in UNRUNNABLE_TYPES:
                raise AtcError("E10041", path, reason=f"weight {tensor.name} is a {UNRUNNABLE_TYPES[tensor.data_type]} "
                                                      "tensor, which no kernel takes")
        for info in (*g.input, *g.output, *g.value_info):
            if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
                dims = info.type.tensor_type.shape.dim
                _check_dims(path, f"tensor {info.name}", [d.dim_value for d in dims if d.HasField("dim_value")],
                            len(dims))
    for info in graph.input:
        if info.type.HasField("tensor_type"):
            _check_input_type(path, info.name, info.type.tensor_type.elem_type)


def _check_input_type(path: Path, name: str, elem_type: int) -> None:
    if elem_type in UNRUNNABLE_TYPES:
        raise AtcError("E10041", path, reason=f"input {name} is a {UNRUNNABLE_TYPES[elem_type]} tensor, "
                                              "which no kernel takes")
    allowed = INTEGER_INPUTS.get(name)
    if allowed and elem_type not in allowed:
        raise AtcError("E10041", path, reason=f"input {name} is {TensorProto.DataType.Name(elem_type).lower()}; "
                                              "token ids must be int32 or int64")


def _check_dims(path: Path, what: str, dims: list[int], rank: int | None = None) -> None:
    rank = len(dims) if rank is None else rank
    if rank > MAX_RANK:
        raise AtcError("E10041", path, reason=f"{what} has rank {rank}; at most {MAX_RANK} is supported")
    for dim in dims:
        if dim < 0 or dim > MAX_DIM:
            raise AtcError("E10041", path, reason=f"{what} has dimension {dim}; dimensions must be between 0 and "
                                                  f"{MAX_DIM}")
