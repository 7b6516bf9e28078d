"""Load an ONNX model and its external data, refusing broken input with ATC error codes.

`load_onnx` reads external data into the TensorProtos; `import_graph` (the compiler's) leaves it on disk
and gives graphsurgeon read-only arrays over a memory map of each data file, so a compile holds only the
weights it makes, not a second copy of the model's. The model is never serialised whole, so models over
protobuf's 2 GiB limit load like any other.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx import external_data_helper, helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from cann_llm.compiler.model_checks import check_model, check_subgraphs, stored_bytes
from cann_llm.passes.constant_conditionals import flatten_constant_conditionals
from cann_llm.runtime.artifact import SUB_BYTE_TYPES
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.proto_utils import initializers_as_inputs


def drop_trailing_empty_inputs(graph: gs.Graph) -> None:
    """Remove the empty names (`""`, an omitted optional input) at the end of every node's inputs, in
    `graph` and its subgraphs: the canonical form of the same node. onnxruntime 1.32 segfaults creating a
    session over a `LayerNormalization` whose omitted bias is written as `""`, and no pass need expect it."""
    for g in (graph, *graph.subgraphs(recursive=True)):
        for node in g.nodes:
            while node.inputs and not node.inputs[-1].name:
                node.inputs.pop()


def cast_like_as_cast(graph: gs.Graph) -> None:
    """`CastLike(x, like)` → `Cast(x, to=like's element type)` where that type is known. onnxruntime expands
    the function op itself, so its kernel list lacks it (the dynamo exporter writes it with `optimize=False`);
    the passes read Casts."""
    for node in graph.nodes:
        if node.op != "CastLike" or node.domain not in ("", "ai.onnx", None) or len(node.inputs) != 2:
            continue
        dtype = node.inputs[1].dtype  # a constant's, read from its proto: its values stay where they are
        if dtype is None:
            continue
        to = dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        node.op = "Cast"
        node.attrs = {"to": to, **({"saturate": node.attrs["saturate"]} if "saturate" in node.attrs else {})}
        del node.inputs[1]


_CONSTANT_ATTRIBUTES = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
                        "value_ints": np.int64}


def typed_constants(graph: gs.Graph) -> None:
    """Constant nodes given by `value_float(s)` or `value_int(s)` → their tensor of float32 or int64, the types
    ONNX gives them: graphsurgeon's folding reads a Python float as float64 and then fails to fold what it
    feeds (the dynamo exporter writes them with `optimize=False`)."""
    for node in graph.nodes:
        found = [name for name in _CONSTANT_ATTRIBUTES if name in node.attrs] if node.op == "Constant" else []
        if len(found) == 1:
            values = np.asarray(node.attrs.pop(found[0]), _CONSTANT_ATTRIBUTES[found[0]])
            node.attrs["value"] = gs.Constant(f"{node.name}_value", values)


def require_model_file(path: str | os.PathLike) -> None:
    """E13001 unless `path` is a regular file."""
    path = Path(path)
    if not path.is_file():
        reason = ("the path is a directory" if path.is_dir() else "not a regular file" if path.exists()
                  else "No such file or directory")
        raise AtcError("E13001", path, reason)


def load_onnx(path: str | os.PathLike, external_data: bool = True) -> onnx.ModelProto:
    """The checked model, with its external data read into memory unless `external_data` is False."""
    path = Path(path)
    require_model_file(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError as error:  # there but unreadable (its permissions, an I/O error): it cannot be opened
        raise AtcError("E13001", path, error.strerror or str(error)) from None
    except (DecodeError, ValueError, RuntimeError) as error:
        raise AtcError("E10041", path, reason=f"the file is not an ONNX model: {error}") from None
    if not model.HasField("graph") or not model.graph.node:
        if model.ByteSize() == 0 or not model.HasField("graph"):
            raise AtcError("E10041", path, reason="the file holds no ONNX model (empty or not a ModelProto)")
        raise AtcError("E16004")
    # checked before the external data is read: the proto stays small (under protobuf's 2 GiB) whatever the
    # weights weigh, and no size below is computed from an unchecked shape
    check_model(model, _without_onnxruntime_default_ops(initializers_as_inputs(model)), path)
    _check_external_data(model, path.parent)
    if external_data:
        external_data_helper.load_external_data_for_model(model, str(path.parent))
    return model


def _without_onnxruntime_default_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (a copy, changed in place) with the ops onnxruntime registers in the default domain but onnx
    does not define (SimplifiedLayerNormalization, which its tools write) moved to com.microsoft: the
    checker has no schema to hold them to, and refuses the default domain's unknown ops but not a contrib
    domain's."""
    from cann_llm.runtime.kernels import supports

    moved = False
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type) and supports("", node.op_type):
            node.domain, moved = "com.microsoft", True
    if moved and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _check_external_data(model: onnx.ModelProto, base: Path) -> None:
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        location = (base / info.location).resolve()
        if base.resolve() not in location.parents and location != base.resolve():
            raise AtcError("E10041", base, reason=f"external data of {tensor.name} points outside the model folder")
        if not location.is_file():
            raise AtcError("E13001", location, f"external data of tensor {tensor.name} is missing")
        size = location.stat().st_size
        offset = info.offset or 0
        length = info.length if info.length is not None else size - offset
        expected = stored_bytes(tensor)
        if expected is not None and length != expected:
            raise AtcError("E10041", location, reason=f"external data of tensor {tensor.name} holds {length} bytes, "
                                                       f"its shape {list(tensor.dims)} needs {expected}")
        if offset + length > size:
            raise AtcError("E10041", location, reason=f"external data is truncated: tensor {tensor.name} needs bytes "
                                                       f"{offset}..{offset + length} of a {size}-byte file")


def weight_bytes(model: onnx.ModelProto) -> int:
    """The size of the model's initializers, inline or external, from their shapes."""
    return sum(stored_bytes(t) or 0 for t in model.graph.initializer)


def import_graph(path: str | os.PathLike) -> tuple[onnx.ModelProto, gs.Graph]:
    """The checked model (external data left on disk) and its graph, whose externally stored constants are
    read-only arrays over memory maps of the data files (pages read on first use, and reclaimable), and
    whose `If`s on constant conditions are already replaced by the branch they take."""
    path = Path(path)
    model = load_onnx(path, external_data=False)
    graph = gs.import_onnx(model)
    drop_trailing_empty_inputs(graph)
    cast_like_as_cast(graph)
    typed_constants(graph)
    flatten_constant_conditionals(graph)
    check_subgraphs(graph, path)
    maps: dict[Path, mmap.mmap] = {}
    for constant in (t for t in graph.tensors().values() if isinstance(t, gs.Constant)):
        lazy = constant._values
        if not isinstance(lazy, LazyValues) or not external_data_helper.uses_external_data(lazy.tensor):
            continue
        if lazy.tensor.data_type in SUB_BYTE_TYPES:  # no numpy type for packed nibbles: read into the proto
            external_data_helper.load_external_data_for_tensor(lazy.tensor, str(path.parent))
            continue
        info = external_data_helper.ExternalDataInfo(lazy.tensor)
        location = path.parent / info.location
        if location not in maps:
            with open(location, "rb") as handle:
                maps[location] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(lazy.tensor.data_type))
        count = int(np.prod(lazy.tensor.dims, dtype=np.int64))
        constant.values = np.frombuffer(maps[location], dtype, count, info.offset or 0).reshape(tuple(lazy.tensor.dims))
        # graphsurgeon would export the array still marked external (with no location): small constants
        # that no pass replaces are written inline, and must not point anywhere
        constant.data_location = None
    return model, graph
