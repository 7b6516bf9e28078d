"""ChatGLM2-6B's and ChatGLM3-6B's decoder as their remote code (`modeling_chatglm.py`) writes it, which
transformers does not ship: everything sequence-first (`[S, B, hidden]` from the embedding's transpose on, the
cache `[P, B, groups, head_dim]` per layer), q, k and v packed in one `query_key_value` with a bias and split
by size, keys and values of `multi_query_group_num` groups broadcast to the heads by `expand`, a rotary
cache of (cos, sin) pairs over the first half of each head rotating neighbouring pairs, indexed by the
positions, torch's `scaled_dot_product_attention` (causal by itself without a past; with a past, the boolean
mask `get_masks` builds from the padding mask, or none for one new token), SwiGLU from one projection cut in
two halves, RMSNorm, and the logits transposed back to `[B, S, vocab]`.

GLM-4-9B-Chat's remote code (`style="glm4"`) is the same model batch-first: the heads moved to the front
before the rotation (`[B, heads, S, D]`, the table `[B, S, R/2, 2]` viewed `[B, 1, S, R/2, 2]`), its cache
`[B, groups, past, D]` and the groups repeated on the second axis. Random weights, for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cann_llm.models.recomputed_greedy import recomputed_greedy

HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS, VOCAB, SEQ_LENGTH = 64, 4, 2, 16, 128, 2, 256, 256


class _RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class _RotaryEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.dim = dim

    def forward(self, max_seq_len: int):
        theta = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
        idx_theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float), theta).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)


STYLES = ("chatglm3", "glm4")


def _apply_rotary_pos_emb_glm4(x, rope_cache):
    b, np_, sq = x.size(0), x.size(1), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:, :sq]
    xshaped = x.reshape(b, np_, sq, rot_dim // 2, 2)
    rope_cache = rope_cache.view(-1, 1, sq, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                          xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


def _apply_rotary_pos_emb(x, rope_cache):
    sq, np_ = x.size(0), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np_, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                          xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


class _SelfAttention(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.query_key_value = nn.Linear(HIDDEN, HEADS * HEAD_DIM + 2 * GROUPS * HEAD_DIM, bias=True)
        self.dense = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache):
        mixed = self.query_key_value(hidden_states)
        q, k, v = mixed.split([HEADS * HEAD_DIM, GROUPS * HEAD_DIM, GROUPS * HEAD_DIM], dim=-1)
        q = q.view(q.size()[:-1] + (HEADS, HEAD_DIM))
        k = k.view(k.size()[:-1] + (GROUPS, HEAD_DIM))
        v = v.view(v.size()[:-1] + (GROUPS, HEAD_DIM))
        if self.style == "glm4":
            return self._batch_first(q, k, v, attention_mask, rotary_pos_emb, kv_cache)
        q, k = _apply_rotary_pos_emb(q, rotary_pos_emb), _apply_rotary_pos_emb(k, rotary_pos_emb)
        if kv_cache is not None:
            k, v = torch.cat((kv_cache[0], k), dim=0), torch.cat((kv_cache[1], v), dim=0)
        present = (k, v)
        k = k.unsqueeze(-2).expand(-1, -1, -1, HEADS // GROUPS, -1)
        k = k.contiguous().view(k.size()[:2] + (HEADS, HEAD_DIM))
        v = v.unsqueeze(-2).expand(-1, -1, -1, HEADS // GROUPS, -1)
        v = v.contiguous().view(v.size()[:2] + (HEADS, HEAD_DIM))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if attention_mask is None and q.shape[2] == k.shape[2]:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            context = F.scaled_dot_product_attention(q, k, v, None if attention_mask is None else ~attention_mask)
        context = context.permute(2, 0, 1, 3)
        context = context.reshape(*context.size()[:-2], HEADS * HEAD_DIM)
        return self.dense(context), present

    def _batch_first(self, q, k, v, attention_mask, rotary_pos_emb, kv_cache):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _apply_rotary_pos_emb_glm4(q, rotary_pos_emb), _apply_rotary_pos_emb_glm4(k, rotary_pos_emb)
        if kv_cache is not None:
            k, v = torch.cat((kv_cache[0], k), dim=2), torch.cat((kv_cache[1], v), dim=2)
        present = (k, v)
        k = k.unsqueeze(2).expand(-1, -1, HEADS // GROUPS, -1, -1)
        k = k.contiguous().view(k.size()[:1] + (HEADS,) + k.size()[3:])
        v = v.unsqueeze(2).expand(-1, -1, HEADS // GROUPS, -1, -1)
        v = v.contiguous().view(v.size()[:1] + (HEADS,) + v.size()[3:])
        if attention_mask is None and q.shape[2] == k.shape[2]:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            context = F.scaled_dot_product_attention(q, k, v, None if attention_mask is None else ~attention_mask)
        context = context.transpose(1, 2)
        return self.dense(context.reshape(*context.size()[:2], HEADS * HEAD_DIM)), present


class _GLMBlock(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _RmsNorm(HIDDEN), _RmsNorm(HIDDEN)
        self.self_attention = _SelfAttention(style)
        self.dense_h_to_4h = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.dense_4h_to_h = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache):
        attended, present = self.self_attention(self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb,
                                                kv_cache)
        hidden_states = hidden_states + attended
        halves = torch.chunk(self.dense_h_to_4h(self.post_attention_layernorm(hidden_states)), 2, dim=-1)
        return hidden_states + self.dense_4h_to_h(F.silu(halves[0]) * halves[1]), present


class ChatGlm(nn.Module):
    """`forward(input_ids, position_ids, attention_mask, *past)` → (logits, *presents), the cache flat: each
    layer's key, then its value, `[length, batch, groups, head_dim]` (`[batch, groups, length, head_dim]` for
    GLM-4)."""

    def __init__(self, style: str = "chatglm3"):
        super().__init__()
        self.style = style
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.rotary_pos_emb = _RotaryEmbedding(HEAD_DIM // 2)
        self.layers = nn.ModuleList(_GLMBlock(style) for _ in range(LAYERS))
        self.final_layernorm = _RmsNorm(HIDDEN)
        self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.return_last_logit = False  # what the remote code's `prepare_inputs_for_generation` asks for

    @staticmethod
    def get_masks(input_ids, past_length: int, padding_mask):
        batch, length = input_ids.shape
        full = torch.ones(batch, length, length).tril_()
        if past_length:
            full = torch.cat((torch.ones(batch, length, past_length), full), dim=-1)
        full = full * padding_mask.unsqueeze(1)
        if not past_length:
            full -= padding_mask.unsqueeze(-1) - 1
        return (full < 0.5).bool().unsqueeze(1)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        length, glm4 = input_ids.shape[1], self.style == "glm4"
        hidden_states = self.word_embeddings(input_ids)
        if not glm4:
            hidden_states = hidden_states.transpose(0, 1).contiguous()
        full_mask = None
        # the remote code's branch on `attention_mask.all()`: a trace takes it with the mask it was given
        if not bool(attention_mask.all()) or (past and length != 1):
            full_mask = self.get_masks(input_ids, past[0].shape[2 if glm4 else 0] if past else 0, attention_mask)
        rotary_pos_emb = self.rotary_pos_emb(SEQ_LENGTH)[position_ids]
        if not glm4:
            rotary_pos_emb = rotary_pos_emb.transpose(0, 1).contiguous()
        presents = []
        for i, layer in enumerate(self.layers):
            hidden_states, present = layer(hidden_states, full_mask, rotary_pos_emb,
                                           (past[2 * i], past[2 * i + 1]) if past else None)
            presents += present
        hidden_states = self.final_layernorm(hidden_states)
        if self.return_last_logit:
            hidden_states = hidden_states[:, -1:] if glm4 else hidden_states[-1:]
        logits = self.output_layer(hidden_states)
        return (logits if glm4 else logits.transpose(0, 1).contiguous(), *presents)


def build_chatglm(seed: int = 0, style: str = "chatglm3") -> ChatGlm:
    """A ChatGLM2/3-shaped (or GLM-4-shaped: `style`, one of STYLES) decoder with random weights, norms and
    all, sharp enough that the rotary's angles decide tokens."""
    torch.manual_seed(seed)
    model = ChatGlm(style).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape))
            elif "embeddings" not in name:
                param.copy_(0.1 * torch.randn(param.shape))
    return model


def greedy(model: ChatGlm, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation, the whole sequence at every step."""
    return recomputed_greedy(lambda ids: model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids))[0],
                             prompt, new_tokens)


def export(model: ChatGlm, path, with_past: bool = True, new_tokens: int = 5, last_logit: bool = False):
    """`model` exported by TorchScript (the dynamo exporter refuses the mask's branch on the data) with
    `new_tokens` new tokens over a past of 3 (or none), the cache under Optimum's names, dynamic shapes; with
    `last_logit`, the logits of the last position alone (`return_last_logit=True`, as `generate` runs it)."""
    from cann_llm.models.export import io_names

    inputs, outputs = io_names(len(model.layers), with_past=with_past)
    inputs = ["input_ids", "position_ids", "attention_mask", *inputs[3:]]
    held, glm4 = (3 if with_past else 0), model.style == "glm4"
    past = [torch.randn(2, GROUPS, held, HEAD_DIM) if glm4 else torch.randn(held, 2, GROUPS, HEAD_DIM)
            for _ in inputs[3:]]
    args = (torch.randint(0, VOCAB, (2, new_tokens)), torch.arange(held, held + new_tokens)[None].repeat(2, 1),
            torch.ones(2, held + new_tokens, dtype=torch.long), *past)
    axes = {"input_ids": {0: "b", 1: "s"}, "position_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "t"},
            **{name: {0: "b", 2: "p"} if glm4 else {0: "p", 1: "b"} for name in inputs[3:]}}
    model.return_last_logit = last_logit
    try:
        with torch.no_grad():
            torch.onnx.export(model, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=axes,
                              dynamo=False, opset_version=17)
    finally:
        model.return_last_logit = False
    return path
