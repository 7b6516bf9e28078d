"""What the compiler records about the optimised graph beside its I/O signature (runtime/signature.py)."""

from __future__ import annotations


from runtime.ops import ATTENTION_OPS, MATMUL_F28, MATMUL_INT4, attributes


def attention_dimensions(graph) -> dict:
    """Layers and head shape from the graph's attention nodes, FusedAttention or PagedAttention (empty when
    attention is not fused)."""
    attentions = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    if not attentions:
        return {}
    attrs = attentions[0].attrs
    return {"num_layers": len(attentions), "num_heads": attrs["num_heads"], "num_kv_heads": attrs["kv_num_heads"],
            "head_dim": attrs["head_dim"]}


def kv_cache_metadata(cfg) -> dict:
    """The KV layout the runtime must provide: contiguous graph I/O, or pages of `page_size` tokens."""
    if cfg.paging is None:
        return {"layout": "contiguous"}
    return {"layout": "paged", "page_size": cfg.paging.page_size}


def shape_contract_metadata(cfg) -> dict:
    """What the runtime holds feeds to (runtime/shape_contract.py): `--input_shape`'s dims and ranges, and the
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
    runs fast only on CPUs with int8 dot products (runtime/compatibility.py)."""
    return any(node.op_type == MATMUL_INT4.name and attributes(node).get("accuracy_level") == 4
               for node in model.graph.node)


def float28_weights(model) -> bool:
    """Whether some matmul of the lowered graph reads float32 weights in 28 bits (MatMulF28), whose kernel
    needs AVX-512 VBMI (elsewhere the runtime unpacks them at load: float32 speed, runtime/compatibility.py)."""
    return any(node.op_type == MATMUL_F28.name for node in model.graph.node)
