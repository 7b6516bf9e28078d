"""Reference generations: Hugging Face transformers' greedy `generate` on the same tiny models."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

NEW_TOKENS = 64


def mixed_prompts(count: int, seed: int = 1, low: int = 2, high: int = 60) -> list[list[int]]:
    """`count` random token prompts of different lengths (ids from 3, clear of the tiny specials)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(low, high, count)]


@lru_cache(maxsize=None)
def _model(family: str):
    from models.tiny import build_tiny_model

    model = build_tiny_model(family)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(family: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), eos ignored."""
    return [list(t) for t in _hf_greedy(family, prompts, new_tokens)]


@lru_cache(maxsize=None)
def _hf_greedy(family: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int) -> tuple[tuple[int, ...], ...]:
    import torch

    model = _model(family)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(tuple(ids[0, len(prompt):].tolist()))
    return tuple(out)


def compile_tiny_chat_model(tmp_path_factory, template: str, name: str = "tiny", **flags):
    """Tiny Llama compiled paged, with its byte tokenizer and `template` as the chat template."""
    import json
    import shutil

    from conftest import compile_to
    from models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(source.with_name("tokenizer.json"), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return compile_to(source, tmp_path_factory.mktemp("om") / name, enable_paged_attention=True, tokenizer=str(folder),
                      **flags)
