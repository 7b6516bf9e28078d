"""The embedded default model: SmolLM2-135M-Instruct (FP32 export) compiles, runs and matches onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import compile_to, ort_reference

from cann_llm.cli.cann_run import cli
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow
RELATIVE_TOLERANCE = 1e-4
PROMPT = "The capital of France is"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_om(smollm2_path, compiled):
    return compiled(smollm2_path)


def test_metadata_describes_the_model(smollm2_om):
    loaded = load_artifact(smollm2_om)
    assert loaded.metadata["model"] == {"vocab_size": 49152, "kv_cache_io": True, "num_layers": 30,
                                        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "family": "llama",
                                        "detected_family": "llama"}
    assert "tokenizer.json" in loaded.om.tokenizer_files()
    ops = [node.op_type for node in loaded.model.graph.node]
    assert ops.count("RmsNorm") + ops.count("AddRmsNorm") == 2 * 30 + 1
    assert ops.count("FusedAttention") == 30 and ops.count("SwiGlu") == 30 and "Softmax" not in ops
    exported = loaded.metadata["pass_report"]["nodes_before"]
    assert len(ops) <= 0.20 * exported


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_prefill_and_decode_logits_match_onnxruntime(smollm2_om, smollm2_path, backend):
    loaded = load_artifact(smollm2_om)
    signature, dims = loaded.metadata["signature"], loaded.metadata["model"]
    tokenizer = TextTokenizer(loaded.om.tokenizer_files())
    ids = np.asarray([tokenizer.encode(PROMPT)], np.int64)
    executor = Executor(loaded, backend)
    prefill = causal_lm_inputs(signature, dims, ids)
    expected, got = ort_reference(smollm2_path, prefill), executor.run(prefill)
    scale = np.abs(expected["logits"]).max()
    for name in expected:
        assert np.abs(got[name] - expected[name]).max() <= RELATIVE_TOLERANCE * max(scale, 1.0), name
    step = causal_lm_inputs(signature, dims, expected["logits"][:, -1:].argmax(-1), past=ids.shape[1])
    for layer in range(dims["num_layers"]):
        for kind in ("key", "value"):
            step[f"past_key_values.{layer}.{kind}"] = expected[f"present.{layer}.{kind}"]
    expected, got = ort_reference(smollm2_path, step), executor.run(step, ["logits"])
    assert np.abs(got["logits"] - expected["logits"]).max() <= RELATIVE_TOLERANCE * np.abs(expected["logits"]).max()


def test_cann_run_prints_onnxruntimes_top_5(smollm2_om, smollm2_path):
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, ["--model", str(smollm2_om), "--prompt", PROMPT, "--topk", "5"])
    assert result.exit_code == 0, result.output
    loaded = load_artifact(smollm2_om)
    ids = np.asarray([TextTokenizer(loaded.om.tokenizer_files()).encode(PROMPT)], np.int64)
    logits = ort_reference(smollm2_path, causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], ids))
    top5 = np.argsort(-logits["logits"][0, -1], kind="stable")[:5]
    printed = [int(line.split("id=")[1].split()[0]) for line in result.output.splitlines() if "id=" in line]
    assert printed == [int(t) for t in top5]


GREEDY_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                  "The three primary colours are", "Water boils at", "My favourite book is",
                  "In 1969, astronauts", "The quick brown fox", "To make a cup of tea, first",
                  "The largest planet in the solar system", "Photosynthesis is the process",
                  "A haiku about autumn:", "The French word for cat is", "Machine learning is",
                  "The speed of light is", "Here is a list of fruits:"]


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2_om):
    """transformers' greedy continuation (NEW_TOKENS, eos ignored) of each prompt: one left-padded batch, masked
    (9x faster than one at a time on 2 cores, the same tokens)."""
    import torch

    from cann_llm.models.prepare import load_smollm2_hf

    model = load_smollm2_hf()
    tokenizer = TextTokenizer(load_artifact(smollm2_om).om.tokenizer_files())
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return prompts, [row[width:].tolist() for row in out]


@pytest.fixture(scope="module")
def smollm2_paged_om(smollm2_path, compiled):
    return compiled(smollm2_path, enable_paged_attention=True)


@pytest.mark.parametrize("layout,drafts", [("paged", 0), ("contiguous", 0), ("paged", 4)])
def test_engine_greedy_equals_transformers(request, smollm2_greedy, layout, drafts):
    from cann_llm.runtime.engine.engine import LLMEngine

    om = request.getfixturevalue("smollm2_paged_om" if layout == "paged" else "smollm2_om")
    prompts, expected = smollm2_greedy
    if layout == "contiguous":  # its runner runs a batch's sequences one by one: four show the same as sixteen
        prompts, expected = prompts[:4], expected[:4]
    with LLMEngine(om, max_batch_size=16, max_context_len=512, kv_cache_pages=32, num_speculative_tokens=drafts,
                   speculative_max_batch=16) as engine:
        alone = engine.submit(prompts[0], max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert alone.result() is not None and alone.output_ids == expected[0]
        requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
        assert [r.result() is not None and r.output_ids for r in requests] == expected
        assert engine.blocks.num_free == engine.blocks.num_pages
        assert (engine.stats.accepted_tokens > 0) == bool(drafts)


def test_force_fp16_stores_every_matmul_weight_and_the_tied_table_in_half_the_bytes(smollm2_om, smollm2_path, tmp_path):
    half = load_artifact(compile_to(smollm2_path, tmp_path / "fp16", precision_mode="force_fp16"))
    narrowed = [t for t in half.model.graph.initializer if t.data_type == 10 and len(t.dims) == 2]
    assert len(narrowed) == 30 * 4 + 1  # QKV, O, gate-up and down of 30 layers; one table for lookup and lm_head
    assert half.om.path.stat().st_size < 0.51 * smollm2_om.stat().st_size
    tokenizer = TextTokenizer(half.om.tokenizer_files())
    ids = np.asarray([tokenizer.encode(PROMPT)], np.int64)
    feeds = causal_lm_inputs(half.metadata["signature"], half.metadata["model"], ids)
    expected, got = ort_reference(smollm2_path, feeds)["logits"], Executor(half).run(feeds, ["logits"])["logits"]
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()
    assert (got[0].argmax(-1) == expected[0].argmax(-1)).mean() >= 0.95


def test_the_export_compiles_paged_with_every_layer_fused(smollm2_paged_om):
    """SmolLM2 as `cann_llm.models.prepare` exports it (`cann-run export`'s code); TorchScript's export is held to the
    same at tiny scale (tests/cli/test_export.py) and in the corpus (Llama by TorchScript)."""
    ops = [node.op_type for node in load_artifact(smollm2_paged_om).model.graph.node]
    assert ops.count("PagedAttention") == 30 and ops.count("RmsNorm") + ops.count("AddRmsNorm") == 61
    assert "Softmax" not in ops
