"""What the compiler records about the optimised graph beside its I/O signature (cann_llm/runtime/signature.py)."""

from __future__ import annotations

from collections import Counter

import onnx

from cann_llm.runtime.ops import (ATTENTION_OPS, GATHER_F28, GATHER_INT4, MATMUL_F28, MATMUL_INT4, MATMUL_INT8,
                                  MICROSOFT_DOMAIN, RECURRENT_CONTRIB_OPS, RECURRENT_ONNXRUNTIME, attributes)


def attention_dimensions(graph) -> dict:
    """Layers and head shape from the graph's attention nodes, FusedAttention or PagedAttention (empty when
    attention is not fused); `layer_kv`, each node's [KV heads, head size], where they differ."""
    attentions = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    if not attentions:
        return {}
    attrs = attentions[0].attrs
    # the first layer's sizes, and each layer's where they differ (Gemma 4's full layers from its sliding ones)
    shapes = [[n.attrs["kv_num_heads"], n.attrs["head_dim"]] for n in attentions]
    return {"num_layers": len(attentions), "num_heads": attrs["num_heads"], "num_kv_heads": attrs["kv_num_heads"],
            "head_dim": attrs["head_dim"], **({"layer_kv": shapes} if any(s != shapes[0] for s in shapes) else {})}


def kv_cache_metadata(cfg) -> dict:
    """The KV layout the runtime must provide: contiguous graph I/O, or pages of `page_size` tokens."""
    if cfg.paging is None:
        return {"layout": "contiguous"}
    return {"layout": "paged", "page_size": cfg.paging.page_size}


def shape_contract_metadata(cfg) -> dict:
    """What the runtime holds feeds to (cann_llm/runtime/shape_contract.py): `--input_shape`'s dims and ranges, and the
    gears of `--dynamic_batch_size` / `--dynamic_dims`; nothing when no input shape was given."""
    if not cfg.input_shapes:
        return {}
    kind = "batch" if cfg.dynamic_batch_size else "dims" if cfg.dynamic_dims else None
    return {"shape_contract": {
        "input_shape": {name: [list(d) if isinstance(d, tuple) else d for d in dims]
                        for name, dims in cfg.input_shapes.items()},
        "gear_kind": kind,
        "gears": [{name: list(shape) for name, shape in gear.items()} for gear in cfg.gears]}}


def int8_activations(model) -> bool:
    """Whether some matmul of the lowered graph takes int8 activations (accuracy level 4: INT4 and W8A8), which
    runs fast only on CPUs with int8 dot products (cann_llm/runtime/compatibility.py)."""
    return any(node.op_type == MATMUL_INT4.name and attributes(node).get("accuracy_level") == 4
               for node in model.graph.node)


def float28_weights(model) -> bool:
    """Whether some matmul of the lowered graph reads float32 weights in 28 bits (MatMulF28), whose kernel
    needs AVX-512 VBMI (elsewhere the runtime unpacks them at load: float32 speed, cann_llm/runtime/compatibility.py)."""
    return any(node.op_type == MATMUL_F28.name for node in model.graph.node)


def onnxruntime_needed(model) -> str | None:
    """The oldest onnxruntime that runs every contrib op of the lowered graph where that is newer than the
    package's floor: a hybrid's recurrent ops (cann_llm/runtime/compatibility.py checks it at load)."""
    recurrent = any(node.domain == MICROSOFT_DOMAIN and node.op_type in RECURRENT_CONTRIB_OPS for node in model.graph.node)
    return RECURRENT_ONNXRUNTIME if recurrent else None


def weight_formats(model, token_input: str | None) -> dict:
    """How the lowered graph stores the weights of its linear layers and its embedding table, as compiled (a
    model quantized before it came here included): each format with its count, e.g.
    `{"matmuls": [{"format": "int4", "block_size": 128, "int8_activations": True, "count": 120}, ...],
    "embedding": {"format": "int4", "block_size": 32}}`; the embedding is the table `token_input` (the graph's
    input_ids) indexes."""
    graph = model.graph
    stored = {t.name: t.data_type for t in graph.initializer}
    made_by = {out: node for node in graph.node for out in node.output}
    counts: Counter = Counter()
    embedding = None
    for node in graph.node:
        kind = None
        if node.op_type in (MATMUL_INT4.name, GATHER_INT4.name):
            attrs = attributes(node)
            kind = (("format", f"int{attrs['bits']}"), ("block_size", attrs["block_size"]),
                    *((("int8_activations", True),) if attrs.get("accuracy_level") == 4 else ()))
        elif node.op_type == MATMUL_INT8.name:
            kind = (("format", "int8"),)
        elif node.op_type in (MATMUL_F28.name, GATHER_F28.name):
            kind = (("format", "float28"),)
        elif node.op_type in ("MatMul", "Gemm", "Gather") and len(node.input) > 1:
            dtype = _stored_type(node.input[0 if node.op_type == "Gather" else 1], stored, made_by)
            kind = (("format", dtype),) if dtype is not None else None
        if kind is None:
            continue
        if node.op_type in (GATHER_INT4.name, GATHER_F28.name, "Gather"):
            indices = node.input[-1 if node.op_type == GATHER_F28.name else 1]
            if token_input is not None and _source(indices, made_by) == token_input:
                embedding = dict(kind)
        else:
            counts[kind] += 1
    matmuls = [{**dict(kind), "count": n} for kind, n in sorted(counts.items(), key=lambda item: -item[1])]
    return {"matmuls": matmuls, **({"embedding": embedding} if embedding else {})}


def _source(name: str, made_by: dict) -> str:
    """`name` traced back through the casts and reshapes between it and what it was made from."""
    while (node := made_by.get(name)) is not None and node.op_type in _LAYOUT_OPS:
        name = node.input[0]
    return name


_LAYOUT_OPS = ("Transpose", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def _stored_type(name: str, stored: dict, made_by: dict) -> str | None:
    """The element type a weight is stored in, read through the layout ops between it and its use (None when
    `name` is not a weight)."""
    name = _source(name, made_by)
    if name not in stored:
        return None
    return onnx.helper.tensor_dtype_to_np_dtype(stored[name]).name if stored[name] != onnx.TensorProto.BFLOAT16 \
        else "bfloat16"
