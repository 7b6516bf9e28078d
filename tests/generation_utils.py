"""Reference generations: Hugging Face transformers' greedy `generate` on the same tiny models."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from cann_llm.runtime.signature import STATE_NAME

NEW_TOKENS = 64


def mixed_prompts(count: int, seed: int = 1, low: int = 2, high: int = 60) -> list[list[int]]:
    """`count` random token prompts of different lengths (ids from 3, clear of the tiny specials)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(low, high, count)]


@lru_cache(maxsize=None)
def _model(family: str, overrides: tuple = ()):
    from cann_llm.models.tiny import build_tiny_model

    model = build_tiny_model(family, overrides=dict(overrides))
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(family: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int = NEW_TOKENS,
              overrides: dict | None = None) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), eos ignored;
    `overrides` as cann_llm.models.tiny.build_tiny_model takes them."""
    return [list(t) for t in _hf_greedy(family, prompts, new_tokens, tuple(sorted((overrides or {}).items())))]


@lru_cache(maxsize=None)
def _hf_greedy(family: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
               overrides: tuple = ()) -> tuple[tuple[int, ...], ...]:
    import torch

    model = _model(family, overrides)
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

    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("llama", dynamo=False, with_past=True)
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(source.with_name("tokenizer.json"), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return compile_to(source, tmp_path_factory.mktemp("om") / name, enable_paged_attention=True, tokenizer=str(folder),
                      **flags)


def ort_greedy(model_path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by onnxruntime on an exported ONNX model itself, the whole sequence at every step
    (an export with KV-cache inputs given an empty past): the export's own cache handling is not what is
    checked, and a TorchScript trace can bake its cache's length in (Gemma 2 and 3's sliding-window cache
    fails in onnxruntime past 15 cached tokens)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    empty = {name: np.zeros((1, value.shape[1], 0, value.shape[3]), np.float32)
             for name, value in inputs.items() if name.startswith("past_key_values")}
    # a hybrid's recurrent states before the first token (its sizes past the batch are fixed)
    empty.update({name: np.zeros((1, *value.shape[1:]), np.float32) for name, value in inputs.items()
                  if STATE_NAME.match(name)})
    ids, tokens = list(prompt), []
    for _ in range(new_tokens):
        feeds = {"input_ids": np.array([ids], np.int64), **empty}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, len(ids)), np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
        if "use_cache_branch" in inputs:  # a legacy merged decoder: its branch without a cache
            feeds["use_cache_branch"] = np.array([False])
        token = int(np.argmax(session.run(["logits"], feeds)[0][0, -1]))
        tokens.append(token)
        ids.append(token)
    return tokens


def engine_greedy(om, prompts: list[list[int]], new_tokens: int, **engine_args) -> list[list[int]]:
    """LLMEngine's greedy tokens for `prompts` submitted together (eos ignored); the engine must be paged
    when the artifact is."""
    from cann_llm import LLMEngine

    settings = dict(max_batch_size=4, max_context_len=128, kv_cache_pages=16) | engine_args
    with LLMEngine(om, **settings) as engine:
        requests = [engine.submit(p, max_new_tokens=new_tokens, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        return [request.output_ids for request in requests]


def greedy_with_preemption(om, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The paged engine's greedy tokens for `prompts` decoded together over six pages they outgrow, prompts in
    chunks of 32 tokens: at least one sequence is preempted and computed again."""
    from cann_llm import LLMEngine

    with LLMEngine(str(om), kv_cache_pages=6, max_num_batched_tokens=32) as engine:
        requests = [engine.submit(p, max_new_tokens=new_tokens, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        assert engine.stats.preemptions > 0
        return [list(request.output_ids) for request in requests]


def assert_paged_greedy_equals_onnxruntime(source, om, new_tokens: int = 32) -> None:
    """Three prompts through the paged engine generate what onnxruntime's greedy loop on the original
    export does."""
    prompts = mixed_prompts(3, seed=7, high=40)  # token ids below 256, inside every test vocabulary
    assert engine_greedy(om, prompts, new_tokens) == [ort_greedy(source, prompt, new_tokens) for prompt in prompts]
