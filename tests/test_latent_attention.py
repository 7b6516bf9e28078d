"""Multi-head latent attention (DeepSeek-V2 and V3, MiniCPM3, GLM-4.7-Flash): exported with transformers' latent cache
(the latent as the key, the rotated key as the value, one head each), run as exported without a paged cache, and
served paged over one key head [latent | rotated key] (cann_llm/passes/absorb_latent_attention.py) with
transformers' greedy tokens."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import compile_to, ort_reference
from generation_utils import greedy_with_preemption

from cann_llm import LLMEngine
from cann_llm.models.corpus_like import build
from cann_llm.models.export import export_causal_lm
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.perplexity import perplexity

# DeepSeek-V3 rotates pairs and routes to experts after a dense layer; DeepSeek-V2 has no query LoRA and rotates in
# complex numbers (exported in real ones); MiniCPM3 rotates halves; GLM-4.7-Flash is DeepSeek-V3's attention with
# its own MoE
CASES = [("deepseek_v3", True), ("deepseek_v2", False), ("minicpm3", False), ("glm4_moe_lite", True)]
LAYERS, LATENT, ROTATED = 2, 32, 8  # cann_llm/models/corpus_like.py's sizes
NEW_TOKENS = 16


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, length).tolist()


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'dynamo' if d else 'ts'}" for f, d in CASES])
def latent(request, tmp_path_factory):
    """(torch model, its export with a cache, its contiguous .om)."""
    family, dynamo = request.param
    folder = tmp_path_factory.mktemp(family)
    model = build(family)
    with torch.no_grad():  # attention sharp enough that a wrong key or position changes the tokens
        for name, param in model.named_parameters():
            if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "q_proj.weight")):
                param.mul_(4.0)
    source = export_causal_lm(model, folder / "model.onnx", dynamo=dynamo, with_past=True)
    return model, source, compile_to(source, folder / "contiguous")


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()


def test_latent_attention_runs_as_exported_without_a_paged_cache(latent):
    """A contiguous compile keeps the export's latent cache I/O and its expansion each step (no fused op), and
    gives onnxruntime's logits over a past on both backends."""
    _, source, om = latent
    loaded = load_artifact(om)
    assert Counter(n.op_type for n in loaded.model.graph.node)["FusedAttention"] == 0
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim[1:]] for i in loaded.model.graph.input}
    assert (shapes["past_key_values.0.key"][-1], shapes["past_key_values.0.value"][-1]) == (LATENT, ROTATED)
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 20)[None])
    want = ort_reference(source, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)


def test_paged_engine_attends_over_the_cached_latent(latent, tmp_path):
    """Every layer one PagedAttention whose cache is a single head of [latent | rotated key]; six prompts decoded
    together over six 16-token pages they outgrow (prompts in chunks, sequences preempted and recomputed):
    each sequence's greedy tokens are transformers' alone, a long prompt's through flash prefill too, and the
    paged perplexity is the export's."""
    model, source, contiguous = latent
    paged = tmp_path / "paged.json"
    paged.write_text(json.dumps({"page_size": 16}))
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True, paged_config=str(paged))
    loaded = load_artifact(om)
    assert Counter(n.op_type for n in loaded.model.graph.node)["PagedAttention"] == LAYERS
    dims = loaded.metadata["model"]
    assert (dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]) == (4, 1, LATENT + ROTATED)
    prompts = [_prompt(length, seed) for seed, length in enumerate([70, 7, 33, 21, 45, 12])]
    outputs = greedy_with_preemption(om, prompts, NEW_TOKENS)
    assert outputs == [_greedy(model, prompt) for prompt in prompts]
    # a prompt of 70 tokens in one chunk attends through flash_prefill
    flash = compile_to(source, tmp_path / "flash", enable_paged_attention=True, enable_flash_attention=True)
    with LLMEngine(str(flash)) as engine:
        request = engine.submit(prompts[0], max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        request.result()
        assert list(request.output_ids) == outputs[0]
    text = _prompt(100, seed=9)
    scores = [perplexity(Executor(load_artifact(path)), text, window=64, stride=32).perplexity
              for path in (om, contiguous)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-5)
