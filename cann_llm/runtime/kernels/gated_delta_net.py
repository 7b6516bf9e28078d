"""Reference kernel of onnxruntime's GatedDeltaNet, the recurrence of a hybrid's gated-delta-net layers
(Qwen3.5, Qwen3-Next): onnxruntime runs the op itself; this is its executable spec for the `reference` backend.

Per value head h, with S its [value size, key size] state (value-major, as the op keeps it) and q, k the
query/key head that h shares (each query/key head serves num_value_heads / num_query_heads value heads):

    S ← exp(g_t) · S;   S ← S + β_t · (v_t − S k_t) ⊗ k_t;   o_t = scale · S q_t
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import GATED_DELTA_NET

MICROSOFT_DOMAIN = "com.microsoft"


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
    (output shaped as `value`, final state). Separate query/key/value, a log-space `decay` and an effective
    `beta`, as exports write it; the op's fused gates, packed QKV and state capture are not modelled."""
    if any(a is not None for a in args) or key is None or update_rule != "gated_delta" or qk_l2_norm \
            or gate_activation != "none" or beta_activation != "none" or initial_state is None:
        raise NotImplementedError("the reference GatedDeltaNet models the gated delta rule over separate query, "
                                  "key and value, with a log-space decay, an effective beta and an initial state")
    del unused
    shape = value.shape
    heads_q, size_k = query.shape[-2:]
    heads_v, size_v = shape[-2:]
    group = heads_v // heads_q
    q = query.reshape(-1, heads_q, size_k).astype(np.float32)
    k = key.reshape(-1, heads_q, size_k).astype(np.float32)
    v = value.reshape(-1, heads_v, size_v).astype(np.float32)
    g = decay.reshape(-1, heads_v).astype(np.float32)
    b = beta.reshape(-1, heads_v).astype(np.float32)
    scale = np.float32(scale or 1.0 / np.sqrt(size_k))
    out = np.zeros_like(v)
    final = initial_state.astype(np.float32).copy()
    for row, span in _sequences(query, cu_seqlens):
        state = final[row]  # [heads_v, size_v, size_k], updated in place
        for t in range(span.start, span.stop):
            qt, kt = np.repeat(q[t], group, axis=0), np.repeat(k[t], group, axis=0)  # [heads_v, size_k]
            state *= np.exp(g[t])[:, None, None]
            delta = b[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", state, kt))
            state += delta[:, :, None] * kt[:, None, :]
            out[t] = scale * np.einsum("hvk,hk->hv", state, qt)
    return out.reshape(shape).astype(value.dtype), final
