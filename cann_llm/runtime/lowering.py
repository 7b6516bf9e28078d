"""Lower `cann` ops onto onnxruntime's kernels (contrib and standard) before a session is built.

Each lowering maps one node to nodes onnxruntime executes with the same semantics (docs/ops.md); ops
without one stay for the host kernels. The artifact keeps the `cann` ops: the lowering is the runtime's
choice, made at load, and the reference backend runs the numpy kernels instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from cann_llm.runtime.ops import (
    ADD_RMS_NORM,
    CUSTOM_DOMAIN,
    MICROSOFT_DOMAIN,
    FUSED_ATTENTION,
    GATHER_INT4,
    MATMUL_INT4,
    MATMUL_INT8,
    MOE,
    PAGED_ATTENTION,
    RMS_NORM,
    SWIGLU,
    SwiGluInput,
    AddRmsNormOutput,
    FusedAttentionInput,
    FusedAttentionOutput,
    GatherInt4Input,
    MatMulQuantInput,
    MoEInput,
    PagedAttentionInput,
    attributes,
)



def _rms_norm(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    # ORT registers SimplifiedLayerNormalization in the default domain; stash_type=1 computes in float32
    return [helper.make_node("SimplifiedLayerNormalization", list(node.input), list(node.output), name=node.name,
                             axis=-1, epsilon=attributes(node)["epsilon"], stash_type=1)]


def _add_rms_norm(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    outputs = list(node.output) + [""] * (len(AddRmsNormOutput) - len(node.output))
    y, total = outputs[AddRmsNormOutput.Y], outputs[AddRmsNormOutput.SUM]
    return [helper.make_node("SkipSimplifiedLayerNormalization", list(node.input), [y, "", "", total],
                             name=node.name, domain=MICROSOFT_DOMAIN, epsilon=attributes(node)["epsilon"])]


def _swiglu(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    x, y = node.input[SwiGluInput.X], node.output[0]
    gate, up, sig, silu = (f"{node.name}/{part}" for part in ("gate", "up", "sigmoid", "silu"))
    # equal halves: implicit before opset 18, spelled with num_outputs from 18 on
    halves = {"num_outputs": 2} if opset >= 18 else {}
    return [helper.make_node("Split", [x], [gate, up], name=f"{node.name}/Split", axis=-1, **halves),
            helper.make_node("Sigmoid", [gate], [sig], name=f"{node.name}/Sigmoid"),
            helper.make_node("Mul", [gate, sig], [silu], name=f"{node.name}/MulSilu"),
            helper.make_node("Mul", [silu, up], [y], name=f"{node.name}/MulUp")]


class Builder:
    """Emits the standard-op nodes of one lowering, with names under the fused node's."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self._count = prefix, [], 0

    def __call__(self, op: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs) -> str | list[str]:
        self._count += 1
        names = [out] if out else [f"{self.prefix}/{op}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), names, name=f"{self.prefix}/{op}_{self._count}", **attrs))
        return names[0] if outputs == 1 else names

    def const(self, values, dtype=np.int64) -> str:
        return self("Constant", value=numpy_helper.from_array(np.asarray(values, dtype=dtype)))


def rotary_embedding(b: Builder, x: str, cos: str, sin: str, rotary_dim: int, head_dim: int, interleaved: int) -> str:
    """Rotate the first `rotary_dim` dims of each head of x [B, H, S, D]: the spelling that
    cann_llm/passes/match_rotary.py reads back (a test holds the two together)."""
    last = b.const([-1])
    rotated = b("Slice", x, b.const([0]), b.const([rotary_dim]), last) if rotary_dim < head_dim else x
    if interleaved:
        two = b.const([2])
        odd = b("Slice", rotated, b.const([1]), b.const([rotary_dim]), last, two)
        even = b("Slice", rotated, b.const([0]), b.const([rotary_dim]), last, two)
        pairs = b("Concat", b("Unsqueeze", b("Neg", odd), last), b("Unsqueeze", even, last), axis=-1)
        turned = b("Reshape", pairs, b.const([0, 0, 0, rotary_dim]))
    else:
        half = rotary_dim // 2
        first = b("Slice", rotated, b.const([0]), b.const([half]), last)
        second = b("Slice", rotated, b.const([half]), b.const([rotary_dim]), last)
        turned = b("Concat", b("Neg", second), first, axis=-1)
    result = b("Add", b("Mul", rotated, cos), b("Mul", turned, sin))
    if rotary_dim < head_dim:
        result = b("Concat", result, b("Slice", x, b.const([rotary_dim]), b.const([head_dim]), last), axis=-1)
    return result


def _fused_attention(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    """Standard ops only: heads split, rotary, KV concat, grouped scores, causal + padding mask, softmax."""
    padded = list(node.input) + [""] * (len(FusedAttentionInput) - len(node.input))
    query, key, value, past_key, past_value, mask, cos, sin, bias = (padded[slot] for slot in FusedAttentionInput)
    output, present_key, present_value = list(node.output) + [""] * (len(FusedAttentionOutput) - len(node.output))
    attrs = attributes(node)
    heads, kv_heads, dim = attrs["num_heads"], attrs["kv_num_heads"], attrs["head_dim"]
    scale, causal, rotary_dim = attrs["scale"], attrs["causal"], attrs["rotary_dim"]
    interleaved = attrs["rotary_interleaved"]
    b = Builder(node.name)
    if not key:
        query, key, value = b("Split", query, b.const([heads * dim, kv_heads * dim, kv_heads * dim]), outputs=3, axis=-1)
    perm = [0, 2, 1, 3]
    q = b("Transpose", b("Reshape", query, b.const([0, 0, heads, dim])), perm=perm)
    k = b("Transpose", b("Reshape", key, b.const([0, 0, kv_heads, dim])), perm=perm)
    v = b("Transpose", b("Reshape", value, b.const([0, 0, kv_heads, dim])), perm=perm)
    if cos:
        q = rotary_embedding(b, q, cos, sin, rotary_dim or dim, dim, interleaved)
        k = rotary_embedding(b, k, cos, sin, rotary_dim or dim, dim, interleaved)
    if past_key:
        k = b("Concat", past_key, k, axis=2, out=present_key or None)
        v = b("Concat", past_value, v, axis=2, out=present_value or None)
    else:
        k = b("Identity", k, out=present_key) if present_key else k
        v = b("Identity", v, out=present_value) if present_value else v
    q5 = b("Reshape", q, b.const([0, kv_heads, heads // kv_heads, -1, dim]))
    k5, v5 = b("Unsqueeze", k, b.const([2])), b("Unsqueeze", v, b.const([2]))
    scores = b("Mul", b("MatMul", q5, b("Transpose", k5, perm=[0, 1, 2, 4, 3])), b.const(scale, np.float32))
    if attrs["softcap"]:
        cap = b.const(attrs["softcap"], np.float32)
        scores = b("Mul", b("Tanh", b("Div", scores, cap)), cap)
    allowed = None
    window, slopes = attrs["sliding_window"], attrs["alibi_slopes"]
    if causal or window or slopes:
        # Gather, not Shape's start and end (opset 15): the lowering keeps the model's opset, 14 included
        seq = b("Gather", b("Shape", q), b.const(2), axis=0)
        total = b("Gather", b("Shape", k), b.const(2), axis=0)
        zero, one = b.const(0), b.const(1)
        rows = b("Unsqueeze", b("Add", b("Range", zero, seq, one), b("Sub", total, seq)), b.const([1]))
        cols = b("Unsqueeze", b("Range", zero, total, one), b.const([0]))
        if slopes:  # m_h·(key position - query position), [Hkv, G, 1, 1] · [S, T] (or [B, 1, 1, S, T])
            if attrs["alibi_from_mask"]:  # positions counted over the keys the mask keeps
                kept = b("Cast", b("Cast", mask, to=onnx.TensorProto.BOOL), to=onnx.TensorProto.INT64)
                counted = b("Sub", b("CumSum", kept, b.const(-1)), one)
                query_rows = b("Slice", counted, b("Unsqueeze", b("Sub", total, seq), b.const([0])),
                               b("Unsqueeze", total, b.const([0])), b.const([1]))
                distance = b("Sub", b("Unsqueeze", counted, b.const([1])), b("Unsqueeze", query_rows, b.const([2])))
                distance = b("Unsqueeze", distance, b.const([1, 2]))
            else:
                distance = b("Sub", cols, rows)
            per_head = b.const(np.asarray(slopes, np.float32).reshape(kv_heads, heads // kv_heads, 1, 1), np.float32)
            scores = b("Add", scores, b("Mul", per_head, b("Cast", distance, to=onnx.TensorProto.FLOAT)))
        if causal:
            allowed = b("LessOrEqual", cols, rows)
        if window:
            recent = b("Greater", cols, b("Sub", rows, b.const(window)))
            allowed = b("And", allowed, recent) if allowed else recent
    if mask:
        padding = b("Unsqueeze", b("Cast", mask, to=onnx.TensorProto.BOOL), b.const([1, 2, 3]))
        allowed = b("And", allowed, padding) if allowed else padding
    minimum = b.const(np.finfo(np.float32).min, np.float32)
    if allowed:
        scores = b("Add", scores, b("Where", allowed, b.const(0.0, np.float32), minimum))
    if bias:
        additive = b("Where", bias, b.const(0.0, np.float32), minimum) if attrs["bias_is_bool"] else bias
        if attrs["bias_per_head"]:
            shape = b("Shape", additive)
            grouped = b("Concat", b("Slice", shape, b.const([0]), b.const([1])),
                        b.const([kv_heads, heads // kv_heads]), b("Slice", shape, b.const([2]), b.const([4])), axis=0)
            additive = b("Reshape", additive, grouped)
        else:
            additive = b("Unsqueeze", additive, b.const([2]))
        scores = b("Add", scores, additive)
    probabilities = None
    if attrs["sinks"]:  # a column of sinks beside the scores [B, Hkv, G, S, T], dropped after the softmax
        sinks = b.const(np.asarray(attrs["sinks"], np.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1), np.float32)
        shape = b("Concat", b("Slice", b("Shape", scores), b.const([0]), b.const([4])), b.const([1]), axis=0)
        joined = b("Softmax", b("Concat", scores, b("Expand", sinks, shape), axis=-1), axis=-1)
        probabilities = b("Slice", joined, b.const([0]), b.const([-1]), b.const([-1]))
    context = b("MatMul", probabilities or b("Softmax", scores, axis=-1), v5)
    merged = b("Transpose", b("Reshape", context, b.const([0, heads, -1, dim])), perm=perm)
    b("Reshape", merged, b.const([0, 0, heads * dim]), out=output)
    return b.nodes


def _matmul_int4(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    # the same operands and attributes, by design: the artifact stores MatMulNBits' layout; an input scale
    # (with_input_scales) goes back to the Mul it came from
    inputs = list(node.input[:MatMulQuantInput.INPUT_SCALE])
    nodes = []
    if len(node.input) > MatMulQuantInput.INPUT_SCALE and node.input[MatMulQuantInput.INPUT_SCALE]:
        scaled = f"{node.name}/scaled_input"
        nodes.append(helper.make_node("Mul", [inputs[0], node.input[MatMulQuantInput.INPUT_SCALE]], [scaled],
                                      name=f"{node.name}/InputScale"))
        inputs[0] = scaled
    return nodes + [helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name,
                                     domain=MICROSOFT_DOMAIN, **attributes(node))]


def _matmul_int8(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    b = Builder(node.name)
    weight = b("DequantizeLinear", *node.input[MatMulQuantInput.B:], axis=1)
    b("MatMul", node.input[MatMulQuantInput.A], weight, out=node.output[0])
    return b.nodes


def _gather_int4(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    # GatherBlockQuantized reads uint8 data as [V, K·bits/8] with MatMulNBits' conventions (default zero point
    # 2^(bits-1)); the Reshape of the constant table is folded by onnxruntime when the session is built
    b = Builder(node.name)
    table, indices, scales = (node.input[slot] for slot in GatherInt4Input)
    attrs = attributes(node)
    flat = b("Reshape", table, b.const([0, -1]))
    b("GatherBlockQuantized", flat, indices, scales, out=node.output[0], domain=MICROSOFT_DOMAIN, gather_axis=0,
      quantize_axis=1, block_size=attrs["block_size"], bits=attrs["bits"])
    return b.nodes


def _moe(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    # the artifact stores gate_up interleaved, the only SwiGLU layout onnxruntime's CPU MoE takes
    # (swiglu_fusion=1), so the kernel reads the mapped weights as they are; it routes as Qwen does: softmax
    # over all experts, top k, optional renormalisation
    x, logits, gate_up, down = (node.input[slot] for slot in MoEInput)
    attrs = attributes(node)
    return [helper.make_node("MoE", [x, logits, gate_up, "", down], list(node.output), name=node.name,
                             domain=MICROSOFT_DOMAIN, k=attrs["top_k"], activation_type="swiglu",
                             swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                             normalize_routing_weights=attrs["normalize_routing_weights"])]


LOWERINGS: dict[str, Callable[[onnx.NodeProto, int], list[onnx.NodeProto]]] = {
    RMS_NORM.name: _rms_norm,
    ADD_RMS_NORM.name: _add_rms_norm,
    SWIGLU.name: _swiglu,
    FUSED_ATTENTION.name: _fused_attention,
    MATMUL_INT4.name: _matmul_int4,
    MATMUL_INT8.name: _matmul_int8,
    GATHER_INT4.name: _gather_int4,
    MOE.name: _moe,
}


def lower_for_onnxruntime(model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool] | None = None) -> onnx.ModelProto:
    """A copy of `model` with every lowerable `cann` node replaced, but those `keep` says a custom-op library
    of the session runs as they are; `model` itself is left alone."""
    if not any(n.domain == CUSTOM_DOMAIN for n in model.graph.node):
        return model
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    opset = next(o.version for o in lowered.opset_import if o.domain in ("", "ai.onnx"))
    nodes = []
    for node in lowered.graph.node:
        rule = LOWERINGS.get(node.op_type) if node.domain == CUSTOM_DOMAIN else None
        if rule is not None and keep is not None and keep(node):
            rule = None
        nodes.extend(rule(node, opset) if rule else [node])
    del lowered.graph.node[:]
    lowered.graph.node.extend(nodes)
    domains = {o.domain for o in lowered.opset_import}
    if MICROSOFT_DOMAIN not in domains:
        lowered.opset_import.append(helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    return lowered


def with_input_scales(model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool]) -> onnx.ModelProto:
    """A copy of `model` where each MatMulInt4 that `keep` gives the native library, reading the product of a
    Mul by a constant [K] vector that nothing else reads (AWQ's 1/s where no norm could take it), reads the
    Mul's other operand and takes the vector as its input scale: the library scales A as it quantizes it, a
    node less a matmul. `model` itself is left alone."""
    graph = model.graph
    vectors = {t.name: t.dims[0] for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 1}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for output in graph.output:
        readers[output.name] = readers.get(output.name, 0) + 1
    muls = {node.output[0]: node for node in graph.node if node.op_type == "Mul" and node.domain in ("", "ai.onnx")
            and len(node.input) == 2 and node.input[1] in vectors}
    moves = {}
    for node in graph.node:
        mul = muls.get(node.input[0]) if node.domain == CUSTOM_DOMAIN and node.op_type == MATMUL_INT4.name else None
        if mul is None or readers[mul.output[0]] != 1 or not keep(node):
            continue
        if vectors[mul.input[1]] == attributes(node)["K"]:
            moves[node.output[0]] = mul
    if not moves:
        return model
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    dropped = {mul.output[0] for mul in moves.values()}
    nodes = []
    for node in moved.graph.node:
        if node.op_type == "Mul" and node.output[0] in dropped:
            continue
        mul = moves.get(node.output[0]) if node.op_type == MATMUL_INT4.name else None
        if mul is not None:
            node.input[0] = mul.input[0]
            node.input.extend([""] * (MatMulQuantInput.INPUT_SCALE - len(node.input)) + [mul.input[1]])
        nodes.append(node)
    del moved.graph.node[:]
    moved.graph.node.extend(nodes)
    return moved


# the page pool as the native PagedAttention's last two inputs (cann_llm/runtime/kernels/native/paged_attention.c)
POOL_KEY, POOL_VALUE = "kv_cache_key", "kv_cache_value"


def with_pool_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedAttention nodes read the page pool as graph inputs `POOL_KEY` and
    `POOL_VALUE` (`[layers, pages, kv_heads, page_size, head_dim]` float32), for the native op that runs
    them inside onnxruntime; `model` itself is left alone."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    width = len(PagedAttentionInput)
    for node in lowered.graph.node:
        if node.domain == CUSTOM_DOMAIN and node.op_type == PAGED_ATTENTION.name:
            node.input.extend([""] * (width - len(node.input)) + [POOL_KEY, POOL_VALUE])
    dims = ["pool_layers", "pool_pages", "pool_kv_heads", "pool_page_size", "pool_head_dim"]
    lowered.graph.input.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims)
                               for name in (POOL_KEY, POOL_VALUE))
    return lowered
