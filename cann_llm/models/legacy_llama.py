"""Decoders of the older Llama lineage as their remote code writes them (Baichuan-7B's and InternLM's
`modeling_*.py`, copied from transformers 4.30's Llama; InternLM-7B's projections each with a bias), which
transformers itself no longer ships: the cache as a flat tuple, a 4-D additive mask built by
`_prepare_decoder_attention_mask`, the masked scores floored at the dtype's lowest value before the softmax,
rotary tables kept as `[1, 1, max_positions, dim]` buffers sliced to the length, and the projections packed
(Baichuan's `W_pack`: q, k and v blocks; InternLM2's `wqkv`: each KV group's queries, then its key and value).

Baichuan-13B and Baichuan2-13B have no rotary: their remote code keeps ALiBi and the causal mask in one
`[heads, max_positions, max_positions]` buffer (`m_h * j` at key j, -inf after the query), sliced to
`[:heads, :T, :T]` for T keys and added to the scores, its last row alone when one token is new
(`mask[:, -1:, :]`, the branch a trace with one new token takes). Baichuan-13B ignores the attention mask
it is given; Baichuan2-13B turns it into `tril(m_i * m_j > 0) * (m_i - m_j == 0)` over query i and key j,
hides what that clears with the lowest float and adds the buffer. Their exports take no `position_ids`.
Random weights, for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cann_llm.models.recomputed_greedy import recomputed_greedy

STYLES = ("baichuan", "internlm", "internlm2", "baichuan13b", "baichuan2_13b")
ALIBI_STYLES = ("baichuan13b", "baichuan2_13b")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB, MAX_POSITIONS = 64, 128, 2, 4, 256, 256


class _RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Rotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        inverse = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(MAX_POSITIONS).float(), inverse)
        table = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", table.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", table.sin()[None, None], persistent=False)

    def forward(self, length: int):
        return self.cos_cached[:, :, :length, ...], self.sin_cached[:, :, :length, ...]


def _alibi_slopes(heads: int) -> list[float]:
    """Baichuan's `_get_interleave`: ALiBi's slopes, the power-of-two sequence interleaved for other counts."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(heads).is_integer():
        return powers(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return powers(closest) + _alibi_slopes(2 * closest)[0::2][:heads - closest]


def _alibi_buffer(heads: int, positions: int) -> torch.Tensor:
    """Baichuan-13B's `_gen_alibi_mask`: [heads, positions, positions], m_h * j at key j, -inf after the query."""
    slopes = torch.tensor(_alibi_slopes(heads))
    alibi = (slopes[:, None, None] * torch.arange(positions)[None, None].expand(heads, -1, -1)).view(heads, 1, positions)
    future = torch.triu(torch.full((positions, positions), float("-inf")), 1)
    return future.unsqueeze(0) + alibi


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, style: str, kv_heads: int):
        super().__init__()
        self.style, self.kv_heads, self.head_dim = style, kv_heads, HIDDEN // HEADS
        if style == "internlm":  # InternLM-7B: Llama's projections, each with a bias (its config's `bias`)
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, HIDDEN, bias=True) for _ in range(3))
        elif style != "internlm2":
            self.W_pack = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        else:
            self.wqkv = nn.Linear(HIDDEN, (HEADS + 2 * kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=style == "internlm")
        if style not in ALIBI_STYLES:
            self.rotary_emb = _Rotary(self.head_dim)

    def forward(self, x, mask, position_ids, past):
        batch, length, _ = x.shape
        if self.style == "internlm":
            q, k, v = (proj(x).view(batch, length, HEADS, self.head_dim).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
        elif self.style != "internlm2":
            packed = self.W_pack(x).unflatten(-1, (3, HIDDEN)).unsqueeze(0).transpose(0, -2).squeeze(-2)
            q, k, v = (packed[i].view(batch, length, HEADS, self.head_dim).transpose(1, 2) for i in range(3))
        else:
            grouped = self.wqkv(x).view(batch, length, -1, HEADS // self.kv_heads + 2, self.head_dim)
            q = grouped[..., : HEADS // self.kv_heads, :].reshape(batch, length, HEADS, self.head_dim).transpose(1, 2)
            k, v = grouped[..., -2, :].transpose(1, 2), grouped[..., -1, :].transpose(1, 2)
        if self.style in ALIBI_STYLES:
            if length == 1:  # the remote code's "inference with cache": the mask's last row
                mask = mask[:, :, -1:, :] if mask.dim() == 4 else mask[:, -1:, :]
        else:
            cos, sin = self.rotary_emb(k.shape[-2] + (past[0].shape[-2] if past else 0))
            cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        present = (k, v)
        if self.kv_heads != HEADS:
            k, v = (t.repeat_interleave(HEADS // self.kv_heads, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        context = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.o_proj(context.transpose(1, 2).reshape(batch, length, HIDDEN)), present


class _Layer(nn.Module):
    def __init__(self, style: str, kv_heads: int):
        super().__init__()
        self.self_attn = _Attention(style, kv_heads)
        self.gate_proj, self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False), nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.input_layernorm, self.post_attention_layernorm = _RmsNorm(HIDDEN), _RmsNorm(HIDDEN)

    def forward(self, x, mask, position_ids, past):
        attended, present = self.self_attn(self.input_layernorm(x), mask, position_ids, past)
        x = x + attended
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), present


class LegacyLlama(nn.Module):
    """`forward(input_ids, attention_mask, position_ids, *past)` → (logits, *presents), the cache flat: each
    layer's key, then its value, `[batch, kv_heads, length, head_dim]`; without `position_ids` for the ALiBi
    styles."""

    def __init__(self, style: str):
        super().__init__()
        self.style, self.kv_heads = style, 2 if style == "internlm2" else HEADS
        if style in ALIBI_STYLES:
            self.register_buffer("future_mask", _alibi_buffer(HEADS, MAX_POSITIONS), persistent=False)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(_Layer(style, self.kv_heads) for _ in range(LAYERS))
        self.norm = _RmsNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    @staticmethod
    def _mask(attention_mask, length: int, past: int, dtype):
        """transformers 4.30's `_prepare_decoder_attention_mask`, as the remote code copied it."""
        lowest = torch.finfo(dtype).min
        causal = torch.full((length, length), lowest)
        steps = torch.arange(length)
        causal = causal.masked_fill(steps < (steps + 1).view(length, 1), 0).to(dtype)
        if past > 0:
            causal = torch.cat([torch.zeros(length, past, dtype=dtype), causal], dim=-1)
        batch = attention_mask.shape[0]
        causal = causal[None, None].expand(batch, 1, length, length + past)
        hidden = 1.0 - attention_mask[:, None, None, :].expand(batch, 1, length, length + past).to(dtype)
        return hidden.masked_fill(hidden.to(torch.bool), lowest) + causal

    def _alibi_mask(self, attention_mask, keys: int, dtype):
        """Baichuan-13B's (the buffer alone) or Baichuan2-13B's (the padding folded in) mask over `keys` keys."""
        alibi = self.future_mask[:HEADS, :keys, :keys]
        if self.style == "baichuan13b":
            return alibi
        kept = attention_mask.to(alibi.dtype)
        kept = torch.tril(torch.gt(kept[:, :, None] * kept[:, None, :], 0)) * torch.eq(kept[:, :, None] - kept[:, None, :], 0)
        src_len, tgt_len = alibi.size()[-2:]  # as the remote code reads them: from the buffer's shape
        kept = kept.unsqueeze(1).expand(attention_mask.shape[0], 1, src_len, tgt_len).to(alibi.dtype)
        hidden = 1.0 - kept
        return hidden.masked_fill(hidden.to(torch.bool), torch.finfo(dtype).min) + alibi.unsqueeze(0)

    def forward(self, input_ids, attention_mask, *rest):
        position_ids, past = (None, rest) if self.style in ALIBI_STYLES else (rest[0], rest[1:])
        x = self.embed_tokens(input_ids)
        if self.style in ALIBI_STYLES:
            mask = self._alibi_mask(attention_mask, input_ids.shape[1] + (past[0].shape[2] if past else 0), x.dtype)
        else:
            mask = self._mask(attention_mask, input_ids.shape[1], past[0].shape[2] if past else 0, x.dtype)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, mask, position_ids, (past[2 * i], past[2 * i + 1]) if past else None)
            presents += present
        return (self.lm_head(self.norm(x)), *presents)


def build_legacy_model(style: str, seed: int = 0) -> LegacyLlama:
    """A `style` decoder (one of STYLES) with random weights, norms and all, sharp enough that the rotary's
    angles decide tokens."""
    torch.manual_seed(seed)
    model = LegacyLlama(style).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape))
            elif param.dim() == 2 and "embed" not in name:
                param.copy_(0.1 * torch.randn(param.shape))
    return model


def greedy(model: LegacyLlama, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation, the whole sequence at every step."""
    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        positions = () if model.style in ALIBI_STYLES else (torch.arange(ids.shape[1])[None],)
        return model(ids, torch.ones_like(ids), *positions)[0]
    return recomputed_greedy(logits_of, prompt, new_tokens)
