"""Hybrid models' recurrent layers through export: their states as cache tensors, their recurrences as
onnxruntime's ops.

Qwen3.5 and Qwen3-Next interleave full attention with gated-delta-net layers, LFM2 with short convolutions,
Granite 4.0-H, Bamba and Nemotron-H with Mamba-2 layers (Falcon-H1 and Zamba2 run Mamba-2 heads beside it).
Such a layer carries a state of fixed size from step to step instead of a growing cache: a convolution's last
inputs (`past.{layer}.conv`, [batch, channels, kernel - 1]) and, for a gated delta net or a Mamba-2 scan, its
recurrent matrix (`past.{layer}.recurrent`, [batch, value heads, value size, key size]), given back as
`present.{layer}.conv` and `.recurrent`: onnxruntime-genai's names and layouts.

Transformers computes the gated delta rule in chunks of 64 tokens, and Mamba-2's scan in chunks of its
config's size, with a Python loop over the chunks, which torch.export writes out for the traced length: its
export fails past one chunk, and TorchScript cannot export the rule's triangular solve at all. During an
export here the rule is one `com.microsoft.GatedDeltaNet` node, and so is the scan (its gated rule, without the
delta), which onnxruntime runs on the CPU for any length (token by token, the state in float32), and each
causal convolution with its state one `com.microsoft.CausalConvWithState`: the two ops whose forms over a
packed batch of sequences (cu_seqlens) the paged engine runs.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


# the layer types transformers gives a state of fixed size instead of keys and values
RECURRENT_TYPES = ("conv", "linear_attention")
# and those it gives both, a recurrence beside the attention (Falcon-H1's Mamba-2 heads in every layer)
PARALLEL_TYPES = ("hybrid", "hybrid_sliding")
# the layer types transformers caches nothing for (a DummyLayer): Nemotron-H's blocks without attention
NO_CACHE_TYPES = ("moe", "mlp")


class Unexportable(NotImplementedError):
    """A model neither exporter can export here (the other exporter would meet the same)."""


@functools.cache
def _transformers_rule():
    """transformers' own chunked rule, read (and kept) before any export swaps the modules' copies of it for
    `_rule`; imported on first use, so exporting a model of another family needs no transformers that has it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


@torch.library.custom_op("cann_export::gated_delta_rule", mutates_args=())
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over [batch, seq, heads, size] query/key/value from `state` [batch, value heads,
    value size, key size]: the output and the final state, as onnxruntime's GatedDeltaNet computes them
    (transformers' own chunked rule, its state transposed to the op's value-major form)."""
    out, final = _transformers_rule()(query, key, value, g=decay, beta=beta, initial_state=state.transpose(-1, -2),
                                      output_final_state=True)
    return out.to(value.dtype), final.transpose(-1, -2).contiguous()


@gated_delta_rule.register_fake
def _(query, key, value, decay, beta, state):
    return torch.empty_like(value), torch.empty_like(state)


@torch.library.custom_op("cann_export::causal_conv", mutates_args=())
def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution of `x` [batch, channels, seq] (`weight` [channels, 1, kernel]) that
    continues from `state` [batch, channels, kernel - 1], the inputs before it: the output (through SiLU
    where `activation` says so) and the new state, as onnxruntime's CausalConvWithState computes them."""
    full = torch.cat([state, x], dim=-1)
    out = torch.nn.functional.conv1d(full, weight, bias, groups=x.shape[1])
    if activation != "none":
        out = torch.nn.functional.silu(out)
    return out, full[..., -state.shape[-1]:].clone()


@causal_conv.register_fake
def _(x, weight, bias, state, activation):
    return torch.empty_like(x), torch.empty_like(state)


@torch.library.custom_op("cann_export::gated_linear_rule", mutates_args=())
def gated_linear_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated linear rule, S ← exp(g_t)·S + v_t ⊗ k_t and o_t = S q_t, over [batch, seq, heads, size]
    query/key/value (each query/key head shared by value heads / query heads value heads) from `state` [batch,
    value heads, value size, key size]: the output and the final state, as onnxruntime's GatedDeltaNet computes
    them with update_rule "gated" and scale 1. It is Mamba-2's selective scan: the key is its B, the query its
    C, the value its input times the time step and the decay the time step times A."""
    group = value.shape[2] // query.shape[2]
    q, k = (x.float().repeat_interleave(group, dim=2) for x in (query, key))
    s, outputs = state.float(), []
    for t in range(value.shape[1]):
        s = s * decay[:, t].float().exp()[..., None, None] + value[:, t].float()[..., None] * k[:, t, :, None, :]
        outputs.append(torch.einsum("bhvk,bhk->bhv", s, q[:, t]))
    out = torch.stack(outputs, dim=1) if outputs else value.float()
    return out.to(value.dtype), s.to(state.dtype)


@gated_linear_rule.register_fake
def _(query, key, value, decay, state):
    return torch.empty_like(value), torch.empty_like(state)


def _onnx_conv(x, weight, bias, state, activation: str):
    """The dynamo exporter's translation: one CausalConvWithState node."""
    from onnxscript import values

    op = values.Op(values.Opset("com.microsoft", 1), "CausalConvWithState", _causal_conv_schema())
    return op(x, weight, bias, state, activation=activation, _outputs=2)


def _causal_conv_schema():
    """The part of onnxruntime's CausalConvWithState schema an export writes."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    return OpSchema("CausalConvWithState", "com.microsoft", 1, inputs=[
        OpSchema.FormalParameter("input", "T"), OpSchema.FormalParameter("weight", "T"),
        OpSchema.FormalParameter("bias", "T", param_option=optional),
        OpSchema.FormalParameter("past_state", "T", param_option=optional)],
        outputs=[OpSchema.FormalParameter("output", "T"), OpSchema.FormalParameter("present_state", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[OpSchema.Attribute("activation", OpSchema.AttrType.STRING, "")])


def _torchscript_conv(g, x, weight, bias, state, activation):
    """TorchScript's symbolic for the same node."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper

    if symbolic_helper._is_none(bias):
        bias = symbolic_helper._optional_input_placeholder_tensor(g)
    return g.op("com.microsoft::CausalConvWithState", x, weight, bias, state,
                activation_s=symbolic_helper._maybe_get_const(activation, "s"), outputs=2)


def _conv_forward(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
    """Stands in for transformers' causal_conv1d_forward (same arguments and result): the convolution
    continues from the layer's conv state (zeros before the first token) and leaves the new one in `cache`."""
    del kwargs
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"a causal convolution through {activation}: onnxruntime's op has SiLU only")
    state = cache.get_conv_state(layer_idx, state_idx=state_idx) if cache is not None else None
    if state is None:
        batch, channels = hidden_states.shape[:2]
        state = hidden_states.new_zeros(batch, channels, conv1d.kernel_size[0] - 1)
    out, state = causal_conv(hidden_states, conv1d.weight, conv1d.bias, state, "none" if activation is None else "silu")
    if cache is not None:
        layer = cache.layers[layer_idx]
        layer.device, layer.dtype = state.device, state.dtype
        layer.conv_states[state_idx] = state
        layer.conv_kernel_size[state_idx] = state.shape[-1]
        layer.is_conv_states_initialized[state_idx] = layer.has_previous_state[state_idx] = True
    return out


def _onnx_rule(query, key, value, decay, beta, state):
    """The dynamo exporter's translation: one GatedDeltaNet node (no cu_seqlens: each row is one sequence)."""
    from onnxscript import values

    op = values.Op(values.Opset("com.microsoft", 1), "GatedDeltaNet", _gated_delta_net_schema())
    return op(query, key, value, None, decay, beta, state, _outputs=2)


def _gated_delta_net_schema():
    """The part of onnxruntime's GatedDeltaNet schema an export writes (onnx's registry knows no contrib op)."""
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    inputs = [OpSchema.FormalParameter("query", "T")] + [
        OpSchema.FormalParameter(name, kind, param_option=optional)
        for name, kind in (("key", "T"), ("value", "T"), ("cu_seqlens", "TI"), ("decay", "T"), ("beta", "T"),
                           ("initial_state", "T"))]
    return OpSchema("GatedDeltaNet", "com.microsoft", 1, inputs=inputs,
                    outputs=[OpSchema.FormalParameter("output", "T"), OpSchema.FormalParameter("final_state", "T")],
                    type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("TI", ["tensor(int32)"], "")],
                    attributes=[OpSchema.Attribute("update_rule", OpSchema.AttrType.STRING, ""),
                                OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "")])


def _onnx_linear_rule(query, key, value, decay, state):
    """The dynamo exporter's translation of `gated_linear_rule`: one GatedDeltaNet node with the gated rule."""
    from onnxscript import values

    op = values.Op(values.Opset("com.microsoft", 1), "GatedDeltaNet", _gated_delta_net_schema())
    return op(query, key, value, None, decay, None, state, update_rule="gated", scale=1.0, _outputs=2)


def _torchscript_linear_rule(g, query, key, value, decay, state):
    """TorchScript's symbolic for the same node."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper

    empty = symbolic_helper._optional_input_placeholder_tensor(g)
    return g.op("com.microsoft::GatedDeltaNet", query, key, value, empty, decay, empty, state,
                update_rule_s="gated", scale_f=1.0, outputs=2)


def _torchscript_rule(g, query, key, value, decay, beta, state):
    """TorchScript's symbolic for the same node."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper

    empty = symbolic_helper._optional_input_placeholder_tensor(g)
    return g.op("com.microsoft::GatedDeltaNet", query, key, value, empty, decay, beta, state, outputs=2)


def _rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, **kwargs):
    """Stands in for transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (same
    arguments and results), the state kept value-major: the cache only stores what this returns.

    The queries' and keys' L2 norm stays in the graph, in transformers' form: onnxruntime's own (`qk_l2_norm`)
    differs from it on short vectors (by 2e-3 in a tiny model's logits)."""
    del chunk_size, kwargs
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) for x in (query.float(), key.float()))
    if initial_state is None:
        batch, heads, size = value.shape[0], value.shape[2], value.shape[3]
        initial_state = value.new_zeros(batch, heads, size, key.shape[-1], dtype=torch.float32)
    out, final = gated_delta_rule(query, key, value, g, beta, initial_state)
    return out, (final if output_final_state else None)


def _mamba2_scan(module, hidden_states, B, C, dt, cache, **kwargs):
    """Stands in for transformers' mamba2_scan_forward (same arguments and result) in Mamba-2 layers (Granite
    4.0-H, Bamba, ...): the scan is `gated_linear_rule` continuing from the layer's recurrent state [batch,
    heads, head size, state size] (zeros before the first token), computed in float32 as transformers' chunked
    scan is, then the D skip connection; the new state is left in `cache`."""
    del kwargs
    batch, seq, _ = hidden_states.shape
    heads, size, groups = module.num_heads, module.head_dim, module.n_groups
    layer = cache.layers[module.layer_idx] if cache is not None else None
    state = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
    if state is None:
        state = hidden_states.new_zeros(batch, heads, size, module.ssm_state_size, dtype=torch.float32)
    dt = torch.nn.functional.softplus(dt + module.dt_bias.to(dt.dtype)).float()
    low, high = module.time_step_limit
    if (low, high) != (0.0, float("inf")):
        dt = dt.clamp(low, high)
    x = hidden_states.view(batch, seq, heads, size).float()
    decay = dt * -torch.exp(module.A_log.float())
    out, final = gated_linear_rule(C.view(batch, seq, groups, -1).float(), B.view(batch, seq, groups, -1).float(),
                                   x * dt[..., None], decay, state)
    out = out + module.D.float()[:, None] * x
    if layer is not None:
        layer.device, layer.dtype = final.device, final.dtype
        layer.recurrent_states[0] = final
        layer.is_recurrent_states_initialized[0] = True
    return out.reshape(batch, seq, heads * size)


def recurrent_layers(config) -> dict[int, str]:
    """{layer index: its type} of the layers with a state of fixed size, alone or beside keys and values (empty
    for a transformer)."""
    types = getattr(config, "layer_types", None) or []
    return {index: kind for index, kind in enumerate(types) if kind in RECURRENT_TYPES + PARALLEL_TYPES}


def state_shapes(model: torch.nn.Module) -> dict[int, dict[str, tuple[int, ...]]]:
    """{layer: {"conv"|"recurrent": shape without the batch axis}} of each recurrent layer's states, read off
    one eager step of the model (the recurrent state value-major, as exported); empty for a transformer."""
    layers = recurrent_layers(model.config)
    if not layers:
        return {}
    if all(kind in RECURRENT_TYPES + NO_CACHE_TYPES for kind in model.config.layer_types):
        raise Unexportable(f"{type(model).__name__} has no attention layer, and transformers' cache sizes its "
                           f"masks by one (its own generate fails the same way)")
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad(), routed_through_onnxruntime(model) as routed:
        model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True,
              **{cache_argument(model): cache})
    unlisted = sorted(routed.convolutions - layers.keys())
    if unlisted:
        raise Unexportable(f"layers {unlisted} of {type(model).__name__} run a causal convolution with a state, "
                           f"and their type is not one the export carries states for")
    shapes = {}
    for index in layers:
        layer = cache.layers[index]
        found = {}
        if getattr(layer, "number_of_states", 1) != 1 or index not in routed.convolutions:
            raise Unexportable(f"layer {index} ({layers[index]}) of {type(model).__name__} is not one "
                               f"causal convolution with one state, as Qwen3.5's, LFM2's and Mamba-2's are")
        found["conv"] = tuple(layer.conv_states[0].shape[1:])
        if layer.is_recurrent_states_initialized[0]:
            found["recurrent"] = tuple(layer.recurrent_states[0].shape[1:])
        shapes[index] = found
    if routed.rules != sum("recurrent" in found for found in shapes.values()):
        # each recurrent layer's mixer: the module of that layer that holds its convolution
        mixers = sorted({type(m).__name__ for m in model.modules()
                         if getattr(m, "layer_idx", None) in layers and hasattr(m, "conv1d")})
        raise Unexportable(f"the recurrence of {type(model).__name__}'s {', '.join(mixers) or 'recurrent'} "
                           f"layers is neither transformers' gated delta rule (Qwen3.5's) nor Mamba-2's "
                           f"scan, which the export writes as onnxruntime's GatedDeltaNet (Mamba-1's "
                           f"selective scan is not)")
    return shapes


def cache_argument(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); the name this model's forward takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def load_states(cache, states: dict[int, dict[str, torch.Tensor]]) -> None:
    """Put each recurrent layer's given states into `cache` (a config-typed DynamicCache) as a step that
    follows earlier ones would find them; copies, since transformers updates them in place."""
    for index, tensors in states.items():
        layer = cache.layers[index]
        conv, recurrent = tensors.get("conv"), tensors.get("recurrent")
        first = conv if conv is not None else recurrent
        layer.device, layer.dtype = first.device, first.dtype
        if conv is not None:
            layer.conv_states[0] = conv.clone()
            layer.conv_kernel_size[0] = conv.shape[-1]
            layer.is_conv_states_initialized[0] = True
            layer.has_previous_state[0] = True
        if recurrent is not None:
            layer.recurrent_states[0] = recurrent.clone()
            layer.is_recurrent_states_initialized[0] = True


def read_states(cache, shapes: dict[int, dict[str, tuple[int, ...]]]) -> dict[int, dict[str, torch.Tensor]]:
    """The states a step left in `cache`, for the layers and kinds of `shapes`."""
    layers = cache.layers
    return {index: {kind: (layers[index].conv_states[0] if kind == "conv" else layers[index].recurrent_states[0])
                    for kind in kinds} for index, kinds in shapes.items()}


def _modeling_modules(model: torch.nn.Module) -> set:
    """The Python modules that define a hybrid's layers (none for a model without recurrent layers)."""
    if not recurrent_layers(model.config):
        return set()
    return {sys.modules[type(module).__module__] for module in model.modules()}


def computes_gated_delta_rule(model: torch.nn.Module) -> bool:
    """Whether the model's recurrent layers are gated delta nets (Qwen3.5's, Qwen3-Next's)."""
    return any(hasattr(module, "torch_chunk_gated_delta_rule") for module in _modeling_modules(model))


@dataclass
class Routed:
    """What ran through the replacements in a `routed_through_onnxruntime` block."""

    rules: int = 0  # calls of the gated delta rule or of Mamba-2's scan
    convolutions: set[int] = field(default_factory=set)  # the layers whose convolution ran


@contextmanager
def routed_through_onnxruntime(model: torch.nn.Module):
    """Within the block, a hybrid's gated delta rule (chunked and token by token) is `gated_delta_rule`, its
    Mamba-2 scan `gated_linear_rule` and its causal convolutions `causal_conv`, which export as onnxruntime's
    GatedDeltaNet and CausalConvWithState; a model without recurrent layers is left as it is. Yields a `Routed`
    that counts what went through."""
    routed = Routed()

    def rule(*args, **kwargs):
        routed.rules += 1
        return _rule(*args, **kwargs)

    def convolution(conv1d, hidden_states, cache, layer_idx, *args, **kwargs):
        routed.convolutions.add(layer_idx)
        return _conv_forward(conv1d, hidden_states, cache, layer_idx, *args, **kwargs)

    def scan(*args, **kwargs):
        routed.rules += 1
        return _mamba2_scan(*args, **kwargs)

    replaced = {"torch_chunk_gated_delta_rule": rule, "torch_recurrent_gated_delta_rule": rule,
                "mamba2_scan_forward": scan, "causal_conv1d_forward": convolution}
    patched = [(module, name, getattr(module, name)) for module in _modeling_modules(model) for name in replaced
               if hasattr(module, name)]
    if any(name == "torch_chunk_gated_delta_rule" for _, name, _ in patched):
        _transformers_rule()  # read before the swap
    for module, name, _ in patched:
        setattr(module, name, replaced[name])
    try:
        yield routed
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def dynamo_translations() -> dict:
    """The custom translation table the dynamo exporter takes for `gated_delta_rule`, `gated_linear_rule` and
    `causal_conv`."""
    return {torch.ops.cann_export.gated_delta_rule.default: _onnx_rule,
            torch.ops.cann_export.gated_linear_rule.default: _onnx_linear_rule,
            torch.ops.cann_export.causal_conv.default: _onnx_conv}


def register_torchscript_symbolic(opset: int) -> None:
    """Let TorchScript's exporter write `gated_delta_rule`, `gated_linear_rule` and `causal_conv` as onnxruntime's
    ops at `opset`."""
    torch.onnx.register_custom_op_symbolic("cann_export::gated_delta_rule", _torchscript_rule, opset)
    torch.onnx.register_custom_op_symbolic("cann_export::gated_linear_rule", _torchscript_linear_rule, opset)
    torch.onnx.register_custom_op_symbolic("cann_export::causal_conv", _torchscript_conv, opset)
