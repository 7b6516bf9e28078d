"""DeepSeek-V2's rotary in real arithmetic, for export.

transformers rotates DeepSeek-V2's (and DeepSeek-Coder-V2's) q and k as complex numbers, `torch.polar` and
`view_as_complex`, which neither exporter writes: TorchScript has no `aten::polar`, and dynamo's ONNX
translation no complex tensors. The rotation is the same, neighbouring pair by pair, in real numbers:

    (x0, x1) → (x0·cos θ − x1·sin θ, x0·sin θ + x1·cos θ)

with the angles' table carried as [..., D/2, 2] (cos θ, sin θ), each scaled by the rotary's attention factor
as the complex table was.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from transformers.modeling_rope_utils import dynamic_rope_update


@dynamic_rope_update  # as transformers' forward: a dynamic or long-context rope type updates its frequencies
def _table(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((angles.cos(), angles.sin()), dim=-1) * self.attention_scaling


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    cos, sin = table[..., 0], table[..., 1]
    return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2).type_as(x)


def _apply(xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    table = table.unsqueeze(1).to(xq.device)  # [B, S, D/2, 2] over the heads of [B, H, S, D]
    return _rotate(xq, table), _rotate(xk, table)


@contextmanager
def rotary_in_real_arithmetic(model: torch.nn.Module):
    """Within the block, a DeepSeek-V2 `model` rotates in real numbers (others are left as they are)."""
    module = sys.modules.get(type(model).__module__)
    rotary = getattr(module, "DeepseekV2RotaryEmbedding", None)
    if rotary is None or not hasattr(module, "apply_rotary_emb"):  # not transformers' DeepSeek-V2 (remote code)
        yield
        return
    forward, apply = rotary.forward, module.apply_rotary_emb
    rotary.forward, module.apply_rotary_emb = _table, _apply
    try:
        yield
    finally:
        rotary.forward, module.apply_rotary_emb = forward, apply
