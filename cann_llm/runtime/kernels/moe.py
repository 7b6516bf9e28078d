"""Reference kernel of cann::MoE, a top-k routed mixture of SwiGLU experts (docs/ops.md is its spec).

Each expert runs only on the tokens routed to it: the point of the op, which the exported graphs miss
(they copy every routed expert's weights once per token before their batched matmuls).
"""

from __future__ import annotations

import numpy as np

from cann_llm.runtime.kernels import register_kernel
from cann_llm.runtime.ops import MOE


def route(router_logits: np.ndarray, top_k: int, normalize: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, k] int64, weights [T, k] float32): softmax over all experts, the k most probable
    (on equal probabilities the lower index first, as ONNX TopK), optionally renormalised to sum to 1."""
    logits = router_logits.astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probabilities, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probabilities, experts, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights


def swiglu_expert(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert on rows x [n, H]: gate_up [2I, H] with gate and up rows interleaved, down [H, I]."""
    projected = x @ gate_up.T
    gate, up = projected[:, 0::2], projected[:, 1::2]
    return (gate / (np.float32(1.0) + np.exp(-gate)) * up) @ down.T


@register_kernel(MOE)
def MoE(x: np.ndarray, router_logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray, *,
        num_experts: int, top_k: int, normalize_routing_weights: int) -> np.ndarray:
    """Σ over each token's k routed experts of weight · SwiGLU expert(token)."""
    hidden = x.shape[-1]
    tokens = x.reshape(-1, hidden).astype(np.float32)
    experts, weights = route(router_logits.reshape(-1, num_experts), top_k, normalize_routing_weights)
    out = np.zeros_like(tokens)
    for expert in np.unique(experts):
        rows, slots = np.nonzero(experts == expert)
        contribution = swiglu_expert(tokens[rows], gate_up[expert], down[expert]) * weights[rows, slots, None]
        out[rows] += contribution  # top-k never picks an expert twice for one token
    return out.reshape(x.shape).astype(x.dtype)
