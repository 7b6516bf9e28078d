"""Human-readable views of a `.om`: ATC's --mode=6 block and the --mode=1 JSON dump.

The JSON follows ATC's Pb2Json of ge.proto.ModelDef: proto field names as keys, maps as arrays of
{"key", "value"}, dtypes as enum names, no weight bytes; graph inputs are Data ops and weights Const ops.
"""

from __future__ import annotations

import onnx
from onnx import helper

from cann_llm.runtime.artifact import OmFile, Partition
from cann_llm.runtime.artifact_schema import SchemaViolation, check_metadata
from cann_llm.runtime.errors import AtcError

_DTYPES = {
    onnx.TensorProto.FLOAT: "DT_FLOAT", onnx.TensorProto.FLOAT16: "DT_FLOAT16", onnx.TensorProto.INT8: "DT_INT8",
    onnx.TensorProto.UINT8: "DT_UINT8", onnx.TensorProto.INT16: "DT_INT16", onnx.TensorProto.UINT16: "DT_UINT16",
    onnx.TensorProto.INT32: "DT_INT32", onnx.TensorProto.INT64: "DT_INT64", onnx.TensorProto.UINT32: "DT_UINT32",
    onnx.TensorProto.UINT64: "DT_UINT64", onnx.TensorProto.BOOL: "DT_BOOL", onnx.TensorProto.DOUBLE: "DT_DOUBLE",
    onnx.TensorProto.BFLOAT16: "DT_BF16", onnx.TensorProto.INT4: "DT_INT4", onnx.TensorProto.UINT4: "DT_UINT4",
    onnx.TensorProto.STRING: "DT_STRING",
}


def display_model_info(om: OmFile) -> str:
    """The --mode=6 / --display_model_info=1 block; E13015 for metadata that breaks its schema."""
    meta, sizes = om.metadata, om.partition_sizes()
    try:
        check_metadata(meta)
    except SchemaViolation as error:
        raise AtcError("E13015", om.path, str(error)) from None
    weights, graph = sizes.get("WEIGHTS_DATA", 0), sizes.get("MODEL_DEF", 0)
    dims = meta.get("model", {})
    kv = meta.get("kv_cache", {})
    page = f"({kv['page_size']} tokens a page)" if "page_size" in kv else ""
    lines = [
        "============ Display Model Info start ============",
        f"Original Atc command line: {meta.get('cmdline', '')}",
        f"system   info: atc_version[{meta.get('atc_version')}], soc_version[{meta.get('soc_version')}], "
        f"framework_type[{meta.get('framework_type')}].",
        f"resource info: memory_size[{weights + graph} B], weight_size[{weights} B], stream_num[1], event_num[0].",
        f"om       info: modeldef_size[{graph} B], weight_data_size[{weights} B], tbe_kernels_size[0 B], "
        f"cust_aicpu_kernel_store_size[0 B], task_info_size[0 B], so_store_size[0 B].",
        f"llm      info: layers[{dims.get('num_layers', '-')}], {_kv_sizes(dims)}, vocab_size[{dims.get('vocab_size', '-')}], "
        f"kv_cache_layout[{kv.get('layout', '-')}{page}], tokenizer[{'yes' if om.tokenizer_files() else 'no'}].",
        f"weight   info: {_weights_line(meta.get('weights'))}.",
        "============ Display Model Info end   ============",
    ]
    return "\n".join(lines)


def _weights_line(weights: dict | None) -> str:
    """How the linear layers and the embedding are stored, e.g. `matmuls[120 int4 block 128 int8-activations,
    1 int4 block 32 int8-activations], embedding[int4 block 32]` (`-` for an artifact that does not record it)."""
    if weights is None:
        return "-"

    def said(kind: dict) -> str:
        return " ".join([kind["format"], *([f"block {kind['block_size']}"] if "block_size" in kind else []),
                         *(["int8-activations"] if kind.get("int8_activations") else [])])

    matmuls = ", ".join(f"{kind['count']} {said(kind)}" for kind in weights["matmuls"])
    embedding = f", embedding[{said(weights['embedding'])}]" if "embedding" in weights else ""
    return f"matmuls[{matmuls or 'none'}]{embedding}"


def _desc(name: str, elem_type: int, dims: list) -> dict:
    return {"name": name, "dtype": _DTYPES.get(elem_type, f"DT_{elem_type}"), "layout": "ND",
            "shape": {"dim": [d if isinstance(d, int) else -1 for d in dims]}}


def _value_desc(value: onnx.ValueInfoProto) -> dict:
    tensor_type = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
    return _desc(value.name, tensor_type.elem_type, dims)


def _attr_value(attr: onnx.AttributeProto) -> dict:
    value = helper.get_attribute_value(attr)
    if attr.type == onnx.AttributeProto.TENSOR:
        return {"t": {"desc": _desc(value.name, value.data_type, list(value.dims))}}
    if attr.type == onnx.AttributeProto.GRAPH:
        return {"g": value.name}
    if isinstance(value, bytes):
        return {"s": value.decode(errors="replace")}
    if isinstance(value, int):
        return {"i": value}
    if isinstance(value, float):
        return {"f": value}
    if isinstance(value, list):
        kind = "f" if value and isinstance(value[0], float) else "s" if value and isinstance(value[0], bytes) else "i"
        return {"list": {kind: [v.decode(errors="replace") if isinstance(v, bytes) else v for v in value]}}
    return {"s": str(value)}


def model_json(model: onnx.ModelProto, model_attrs: dict) -> dict:
    """ModelDef-shaped JSON of an ONNX graph; `model_attrs` become the model's `attr` list."""
    graph = model.graph
    types = {v.name: v for v in list(graph.value_info) + list(graph.input) + list(graph.output)}
    source = {}
    ops = []
    initializers = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name not in initializers:
            source[value.name] = f"{value.name}:0"
            ops.append({"name": value.name, "type": "Data", "output_desc": [_value_desc(value)]})
    for tensor in graph.initializer:
        source[tensor.name] = f"{tensor.name}:0"
        ops.append({"name": tensor.name, "type": "Const",
                    "output_desc": [_desc(tensor.name, tensor.data_type, list(tensor.dims))]})
    for node in graph.node:
        for index, name in enumerate(node.output):
            source[name] = f"{node.name}:{index}"
    for node in graph.node:
        op = {"name": node.name, "type": node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}",
              "input": [source.get(name, "") for name in node.input]}
        if node.attribute:
            op["attr"] = [{"key": a.name, "value": _attr_value(a)} for a in node.attribute]
        descs = [_value_desc(types[name]) for name in node.output if name in types]
        if descs:
            op["output_desc"] = descs
        ops.append(op)
    attrs = [{"key": key, "value": {"i": value} if isinstance(value, int) else {"s": str(value)}}
             for key, value in sorted(model_attrs.items())]
    return {"name": graph.name, "version": model.ir_version,
            "graph": [{"name": graph.name, "input": [source[v.name] for v in graph.input if v.name in source],
                       "output": [source.get(v.name, v.name) for v in graph.output], "op": ops}],
            "attr": attrs}


def om_json(om: OmFile) -> dict:
    """--mode=1 JSON of a compiled artifact."""
    meta = om.metadata
    attrs = {"atc_cmdline": meta.get("cmdline", ""), "atc_version": meta.get("atc_version", ""),
             "soc_version": meta.get("soc_version", ""), "framework_type": meta.get("framework_type", 5),
             "om_info_list": " ".join(f"{k}:{v}" for k, v in sorted(om.partition_sizes().items()))}
    document = model_json(om.graph(), attrs)
    document["name"] = meta.get("name", document["name"])
    document["metadata"] = meta
    if Partition.TOKENIZER.name in om.partition_sizes():
        document["tokenizer_files"] = sorted(om.tokenizer_files())
    return document


def _kv_sizes(dims: dict) -> str:
    """`kv_heads[2], head_dim[64]`, or each layer's `kv_sizes[2x16, 1x32, ...]` where they differ."""
    if "layer_kv" in dims:
        return f"kv_sizes[{', '.join(f'{heads}x{size}' for heads, size in dims['layer_kv'])}] (kv_heads x head_dim)"
    return f"kv_heads[{dims.get('num_kv_heads', '-')}], head_dim[{dims.get('head_dim', '-')}]"
