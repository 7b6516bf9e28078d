"""Reference kernels of onnxruntime's recurrent ops, which a hybrid's export carries
(cann_llm/models/recurrent_export.py): onnxruntime runs them itself; these are their executable spec for the
`reference` backend.

GatedDeltaNet (Qwen3.5's and Qwen3-Next's linear attention), per value head h, with S its [value size, key
size] state (value-major, as the op keeps it) and q, k the query/key head that h shares (each query/key head
serves num_value_heads / num_query_heads value heads):

    S ← exp(g_t) · S;   S ← S + β_t · (v_t − S k_t) ⊗ k_t;   o_t = scale · S q_t

and with update_rule "gated" (Mamba-2's scan: k its B, q its C, v its input times the time step) the same
without the delta:

    S ← exp(g_t) · S;   S ← S + v_t ⊗ k_t;   o_t = scale · S q_t

CausalConvWithState and VarlenCausalConvWithState (the short convolutions of LFM2 and of Qwen3.5's q/k/v): a
depthwise convolution over each sequence's tokens that continues from its state, the kernel − 1 inputs
before them, then gives the last kernel − 1 back as the new state.
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import (CAUSAL_CONV_WITH_STATE, GATED_DELTA_NET, MICROSOFT_DOMAIN,
                                  VARLEN_CAUSAL_CONV_WITH_STATE)

def _sequences(query: np.ndarray, cu_seqlens: np.ndarray | None) -> list[tuple[int, slice]]:
    """(state row, token slice) of each sequence: a row of the rank-4 [batch, seq, ...] form each, or the
    cu_seqlens spans of the packed rank-3 [tokens, ...] form."""
    if cu_seqlens is None:
        return [(b, slice(b * query.shape[1], (b + 1) * query.shape[1])) for b in range(query.shape[0])]
    return [(b, slice(int(start), int(end))) for b, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:]))]


@register_kernel(GATED_DELTA_NET, domain=MICROSOFT_DOMAIN)
def GatedDeltaNet(query, key, value, cu_seqlens, decay, beta, initial_state, *args, scale: float,
                  qk_l2_norm: int, update_rule: str, gate_activation: str, beta_activation: str, **unused):
    """The recurrence token by token from `initial_state` [batch, value heads, value size, key size]:
    (output shaped as `value`, final state). Separate query/key/value, a log-space `decay` and (the delta rule)
    an effective `beta`, as exports write it; the op's fused gates, packed QKV and state capture are not
    modelled."""
    delta = update_rule == "gated_delta"
    if any(a is not None for a in args) or key is None or update_rule not in ("gated_delta", "gated") or qk_l2_norm \
            or gate_activation != "none" or beta_activation != "none" or initial_state is None \
            or (beta is None) == delta:
        raise NotImplementedError("the reference GatedDeltaNet models the gated (delta) rule over separate query, "
                                  "key and value, with a log-space decay, an effective beta for the delta rule "
                                  "and an initial state")
    del unused
    shape = value.shape
    heads_q, size_k = query.shape[-2:]
    heads_v, size_v = shape[-2:]
    group = heads_v // heads_q
    q = query.reshape(-1, heads_q, size_k).astype(np.float32)
    k = key.reshape(-1, heads_q, size_k).astype(np.float32)
    v = value.reshape(-1, heads_v, size_v).astype(np.float32)
    g = decay.reshape(-1, heads_v).astype(np.float32)
    b = beta.reshape(-1, heads_v).astype(np.float32) if delta else None
    scale = np.float32(scale or 1.0 / np.sqrt(size_k))
    out = np.zeros_like(v)
    final = initial_state.astype(np.float32).copy()
    for row, span in _sequences(query, cu_seqlens):
        state = final[row]  # [heads_v, size_v, size_k], updated in place
        for t in range(span.start, span.stop):
            qt, kt = np.repeat(q[t], group, axis=0), np.repeat(k[t], group, axis=0)  # [heads_v, size_k]
            state *= np.exp(g[t])[:, None, None]
            added = b[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", state, kt)) if delta else v[t]
            state += added[:, :, None] * kt[:, None, :]
            out[t] = scale * np.einsum("hvk,hk->hv", state, qt)
    return out.reshape(shape).astype(value.dtype), final


def _convolve(x: np.ndarray, weight: np.ndarray, bias, state: np.ndarray, activation: str):
    """One sequence: `x` [channels, tokens] after `state` [channels, kernel - 1]; (output, new state)."""
    kernel = weight.shape[-1]
    full = np.concatenate([state, x], axis=-1).astype(np.float32)
    taps = weight.reshape(weight.shape[0], kernel).astype(np.float32)
    out = sum(taps[:, j:j + 1] * full[:, j:j + x.shape[-1]] for j in range(kernel))
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = out / (np.float32(1.0) + np.exp(-out))
    return out, full[:, full.shape[-1] - state.shape[-1]:]


def _conv_supported(activation: str, dilation: int, *extra) -> None:
    if activation not in ("none", "silu", "swish") or dilation != 1 or any(a is not None for a in extra):
        raise NotImplementedError("the reference causal convolutions model one spatial axis, undilated, "
                                  "channels first, without state capture")


@register_kernel(CAUSAL_CONV_WITH_STATE, domain=MICROSOFT_DOMAIN)
def CausalConvWithState(x, weight, bias, past_state, *, activation: str, dilation: int, channels_last: int,
                        ndim: int, **unused):
    """`x` [batch, channels, tokens] each row after its `past_state` [batch, channels, kernel - 1] (zeros when
    absent): (output, present state)."""
    _conv_supported(activation, dilation, *([1] if channels_last or ndim != 1 else []))
    del unused
    if past_state is None:
        past_state = np.zeros((*x.shape[:2], weight.shape[-1] - 1), x.dtype)
    rows = [_convolve(x[b], weight, bias, past_state[b], activation) for b in range(x.shape[0])]
    return (np.stack([out for out, _ in rows]).astype(x.dtype),
            np.stack([state for _, state in rows]).astype(past_state.dtype))


@register_kernel(VARLEN_CAUSAL_CONV_WITH_STATE, domain=MICROSOFT_DOMAIN)
def VarlenCausalConvWithState(x, weight, cumulative_sequence_length, bias, initial_state, *args, activation: str,
                              dilation: int, **unused):
    """`x` [tokens, channels], the sequences packed by `cumulative_sequence_length`, each after its row of
    `initial_state` [sequences, channels, kernel - 1]: (output [tokens, channels], final state)."""
    _conv_supported(activation, dilation, *args)
    del unused
    out = np.empty_like(x)
    final = initial_state.copy()
    bounds = cumulative_sequence_length
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        result, final[b] = _convolve(x[start:end].T, weight, bias, initial_state[b], activation)
        out[start:end] = result.T
    return out, final
