"""Tiny, seeded, randomly initialised Hugging Face models, exported to ONNX and cached on disk.

`tiny_onnx("llama", dynamo=True, with_past=True)` returns the path of an exported model, building it the
first time. Attention is transformers' default implementation (`sdpa`), as users export it;
`attention="eager"` gives the other spelling. The cache is `cache_dir()`'s folder (`.cache` in a checkout, which git ignores).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cann_llm.runtime.cache_home import cache_home

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Where generated models and artifacts are kept: `$CANN_LLM_CACHE`, else `.cache` in a checkout of the
    project (git ignores it), else the user's cache folder (~/.cache/cann-llm), never inside an installed
    package nor an application that vendors it."""
    if os.environ.get("CANN_LLM_CACHE"):
        return Path(os.environ["CANN_LLM_CACHE"])
    if _in_checkout():
        return REPO_ROOT / ".cache"
    return cache_home()


def _in_checkout() -> bool:
    """Whether the package runs from this project's own source tree (its pyproject.toml beside it)."""
    try:
        project = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return re.search(r'^name = "cann-llm"$', project, re.M) is not None


def publish_folder(folder: Path, target: Path, marker: str) -> None:
    """Move a finished `folder` to `target`; parallel builders may race, and the first complete one wins."""
    try:
        os.replace(folder, target)
    except OSError:
        if not (target / marker).exists():
            raise


@dataclass(frozen=True)
class TinySpec:
    """What one tiny family is: its transformers config class and the sizes we give it."""

    config_class: str
    model_class: str
    sizes: dict = field(default_factory=dict)


_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)

TINY_FAMILIES: dict[str, TinySpec] = {
    "llama": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, rms_norm_eps=1e-6)),
    # SmolLM2's shape: the lm_head is the embedding table, transposed
    "llama_tied": TinySpec("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen2": TinySpec("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # transformers' default sliding window (4,096), as users export Mistral
    "mistral": TinySpec("MistralConfig", "MistralForCausalLM", dict(_COMMON, num_key_value_heads=1)),
    "glm": TinySpec("GlmConfig", "GlmForCausalLM", dict(_COMMON, head_dim=16, partial_rotary_factor=0.5,
                                                        pad_token_id=0, eos_token_id=1)),
    "phi3": TinySpec("Phi3Config", "Phi3ForCausalLM", dict(_COMMON, pad_token_id=0)),
    "gemma": TinySpec("GemmaConfig", "GemmaForCausalLM", dict(_COMMON, head_dim=16)),
    "qwen3": TinySpec("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=16)),
    "qwen2_moe": TinySpec("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                          dict(_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64)),
    "qwen3_moe": TinySpec("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                          dict(_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gpt2": TinySpec("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                                          n_positions=256)),
}


ATTENTIONS = ("sdpa", "eager")  # transformers' default first


def build_tiny_model(family: str, seed: int = 0, attention: str = "sdpa", overrides: dict | None = None):
    """A randomly initialised model whose norm weights and biases are re-drawn too; `overrides` replaces
    config fields of the family's sizes (e.g. `norm_topk_prob=True`, or a bigger MoE for a benchmark).

    transformers initialises norm weights to 1 and biases to 0, and a fusion that drops them would still
    match such a reference; re-drawing them from the seed makes every parameter count.
    """
    import torch
    import transformers

    spec = TINY_FAMILIES[family]
    config = getattr(transformers, spec.config_class)(**{**spec.sizes, **(overrides or {})})
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config)
    if hasattr(model, "set_experts_implementation"):
        # the default grouped experts cannot be exported; batched_mm runs every expert on every token
        model.set_experts_implementation("batched_mm")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen) if "norm" in name
                            else 0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def byte_tokenizer_json() -> str:
    """A real tokenizer for the 256-token tiny models: byte-level BPE without merges (one token a byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def tiny_onnx_path(family: str, *, dynamo: bool, with_past: bool, seed: int = 0, attention: str = "sdpa",
                   overrides: dict | None = None) -> Path:
    """Where `tiny_onnx` keeps that export (it may not be made yet)."""
    tag = f"{family}-{'dynamo' if dynamo else 'ts'}-{'kv' if with_past else 'nokv'}-{attention}-s{seed}"
    tag += "".join(f"-{key}={value}" for key, value in sorted((overrides or {}).items()))
    # the sizes are part of the name, so a changed TinySpec never reads a stale export
    sizes = json.dumps(TINY_FAMILIES[family].sizes, sort_keys=True, default=str)
    tag += "-" + hashlib.sha1(sizes.encode()).hexdigest()[:8]
    return cache_dir() / "tiny" / tag / "model.onnx"


def tiny_onnx(family: str, *, dynamo: bool, with_past: bool, seed: int = 0, attention: str = "sdpa",
              overrides: dict | None = None) -> Path:
    """Path of the exported tiny model (its byte tokenizer beside it), exporting it on first use."""
    from cann_llm.models.export import export_causal_lm
    from cann_llm.runtime.made_once import made_once

    path = tiny_onnx_path(family, dynamo=dynamo, with_past=with_past, seed=seed, attention=attention,
                          overrides=overrides)
    # parallel test workers want the same exports at the same time: one exports, the others wait for it
    made_once(path, lambda: export_causal_lm(build_tiny_model(family, seed, attention, overrides), path,
                                             dynamo=dynamo, with_past=with_past), "export.lock")
    tokenizer = path.with_name("tokenizer.json")
    if not tokenizer.exists():  # written atomically: parallel test workers may race to write it
        partial = tokenizer.with_name(f"tokenizer.{os.getpid()}.partial")
        partial.write_text(byte_tokenizer_json(), encoding="utf-8")
        os.replace(partial, tokenizer)
    return path
