"""Hybrid models: Qwen3.5's gated delta nets and LFM2's short convolutions between attention layers, exported
with their states as cache tensors (cann_llm/models/recurrent_export.py), compiled contiguous and paged and
generating as transformers does, past the 64 tokens that transformers' own chunked rule exports for."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import compile_to
from generation_utils import greedy_with_preemption

from cann_llm import LLMEngine, SamplingParams
from cann_llm.models.corpus_like import build
from cann_llm.models.export import export_causal_lm
from cann_llm.models.hf_export import ExportConfig, export_checkpoint
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.engine.draft_model import DraftModelProposer
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import RECURRENT_ONNXRUNTIME
from cann_llm.runtime.perplexity import perplexity

# (family, exporter): transformers' Qwen3.5 splits its tokens with torch.tensor_split, which TorchScript cannot
# export, so it goes through dynamo only; LFM2's states through the other exporter; Mamba-2's scan through
# both (Granite 4.0-H's attention reads no positions, and TorchScript drops its position_ids; Nemotron-H's
# MLP blocks cache nothing, so its attention layer's cache is layer 2's; Falcon-H1's layers each cache keys,
# values and states)
CASES = [("qwen3_5", "dynamo"), ("lfm2", "ts"), ("granitemoehybrid", "ts"), ("nemotron_h", "dynamo"),
         ("falcon_h1", "ts")]
GATED = {"qwen3_5", "granitemoehybrid", "nemotron_h", "falcon_h1"}  # a GatedDeltaNet in a recurrent layer
LAYERS = {"falcon_h1": (2, 2)}  # (attention layers, recurrent layers), one each elsewhere
IO = {
    "granitemoehybrid": (["past.0.conv", "past.0.recurrent", "past_key_values.1.key", "past_key_values.1.value"],
                         ["present.0.conv", "present.0.recurrent", "present.1.key", "present.1.value"]),
    "nemotron_h": (["past.0.conv", "past.0.recurrent", "past_key_values.2.key", "past_key_values.2.value"],
                   ["present.0.conv", "present.0.recurrent", "present.2.key", "present.2.value"]),
    "falcon_h1": ([f"{prefix}.{i}.{kind}" for i in range(2) for prefix, kind in (
                      ("past_key_values", "key"), ("past_key_values", "value"), ("past", "conv"), ("past", "recurrent"))],
                  [f"present.{i}.{kind}" for i in range(2) for kind in ("key", "value", "conv", "recurrent")]),
    "qwen3_5": (["past.0.conv", "past.0.recurrent", "past_key_values.1.key", "past_key_values.1.value"],
                ["present.0.conv", "present.0.recurrent", "present.1.key", "present.1.value"]),
    "lfm2": (["past.0.conv", "past_key_values.1.key", "past_key_values.1.value"],
             ["present.0.conv", "present.1.key", "present.1.value"]),
}
PROMPTS = {"long": 90, "short": 7}  # the long one crosses transformers' 64-token chunk
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """`hybrid(family, exporter)`: (torch model, its export with a cache, the contiguous .om), made once."""
    made = {}

    def get(family: str, exporter: str):
        if (family, exporter) not in made:
            folder = tmp_path_factory.mktemp(f"{family}-{exporter}")
            model = build(family).eval()
            source = export_causal_lm(model, folder / "model.onnx", dynamo=exporter == "dynamo", with_past=True)
            made[family, exporter] = model, source, compile_to(source, folder / "m")
        return made[family, exporter]

    return get


def _prompt(length: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 512, length)]


@pytest.mark.parametrize("family,exporter", CASES)
def test_export_carries_states_and_matches_torch_past_a_chunk(hybrid, family, exporter):
    """A prefill of 100 tokens, then 20 steps of one token each, each step fed the states and cache the last
    gave back, equal transformers' logits over the whole sequence at once."""
    model, source, _ = hybrid(family, exporter)
    graph = onnx.load(source).graph
    inputs, outputs = IO[family]
    positions = ["position_ids"] if (family, exporter) != ("granitemoehybrid", "ts") else []
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", *positions, *inputs]
    assert [o.name for o in graph.output] == ["logits", *outputs]
    recurrent = LAYERS.get(family, (1, 1))[1]
    assert Counter(n.op_type for n in graph.node)["GatedDeltaNet"] == recurrent * (family in GATED)
    session = ort.InferenceSession(str(source))
    # before the first token: a batch of one, the caches' sequence axes empty, the states zeros
    carried = {i.name: np.zeros([1, *(0 if isinstance(d, str) else d for d in i.shape[1:])], np.float32)
               for i in session.get_inputs() if i.name in inputs}
    ids = np.array([_prompt(120)])
    logits, done = [], 0
    for step in [100] + [1] * 20:
        feeds = {"input_ids": ids[:, done:done + step], "attention_mask": np.ones((1, done + step), np.int64),
                 **({"position_ids": np.arange(done, done + step)[None]} if positions else {}), **carried}
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        logits.append(got["logits"])
        carried = {name: got[present] for name, present in zip(inputs, outputs)}
        done += step
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(np.concatenate(logits, axis=1), expected, rtol=0, atol=1e-4)


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,exporter", CASES)
def test_contiguous_engine_generates_transformers_greedy_tokens(hybrid, family, exporter):
    model, _, om = hybrid(family, exporter)
    # the attention layers fused (Qwen3.5's heads of [query | gate] cut into two projections first), the
    # recurrent layers left to onnxruntime's ops
    loaded = load_artifact(om)
    ops = Counter(node.op_type for node in loaded.model.graph.node)
    attention, recurrent = LAYERS.get(family, (1, 1))
    assert (ops["FusedAttention"], ops["Softmax"], ops["GatedDeltaNet"], ops["CausalConvWithState"]) == \
        (attention, 0, recurrent * (family in GATED), recurrent)
    assert loaded.metadata["requires"]["onnxruntime"] == RECURRENT_ONNXRUNTIME  # its contrib ops' CPU kernels
    prompts = [_prompt(length, seed) for seed, length in enumerate(PROMPTS.values())]
    engine = LLMEngine(str(om))
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == _greedy(model, prompt)


@pytest.mark.parametrize("family,exporter", CASES)
def test_paged_engine_batches_hybrids_with_their_states_per_sequence(hybrid, family, exporter, tmp_path):
    """Six prompts decoded together in a flattened batch, prompts in chunks of 32 tokens, over six pages of 16
    tokens that the running sequences outgrow (so sequences are preempted and computed again from zeros):
    each sequence's greedy tokens are transformers' alone."""
    model, source, contiguous = hybrid(family, exporter)
    paged = tmp_path / "paged.json"
    paged.write_text(json.dumps({"page_size": 16}))
    om = compile_to(source, tmp_path / "paged", enable_paged_attention=True, paged_config=str(paged))
    ops = Counter(node.op_type for node in load_artifact(om).model.graph.node)
    attention, recurrent = LAYERS.get(family, (1, 1))
    assert (ops["PagedAttention"], ops["VarlenCausalConvWithState"], ops["GatedDeltaNet"]) == \
        (attention, recurrent, recurrent * (family in GATED))
    prompts = [_prompt(length, seed) for seed, length in enumerate([70, 7, 33, 21, 45, 12])]
    outputs = greedy_with_preemption(om, prompts, NEW_TOKENS)
    assert outputs == [_greedy(model, prompt) for prompt in prompts]
    # a perplexity window is one sequence from zero states, paged as contiguous
    text = _prompt(100, seed=9)
    scores = [perplexity(Executor(load_artifact(path)), text, window=64, stride=32).perplexity
              for path in (om, contiguous)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-5)


def test_speculation_and_pipeline_stages_are_refused_with_codes(hybrid, tmp_path):
    """A state cannot give back a rejected draft, as a target or as a draft, and one process's engine keeps
    the states."""
    _, source, om = hybrid("lfm2", "ts")
    with pytest.raises(AtcError) as speculating:
        LLMEngine(str(om), num_speculative_tokens=3)
    assert speculating.value.code == "E10001" and "num_speculative_tokens" in str(speculating.value)
    paged = compile_to(source, tmp_path / "paged", enable_paged_attention=True)
    with pytest.raises(AtcError) as drafting:
        DraftModelProposer(str(paged), num_tokens=2, num_pages=4, vocab_size=512)
    assert drafting.value.code == "E10001" and "--draft_model" in str(drafting.value)
    with pytest.raises(AtcError) as staged:
        compile_to(source, tmp_path / "staged", enable_paged_attention=True, pipeline_stages=2)
    assert staged.value.code == "E10055" and "recurrent" in str(staged.value)
    assert not list(tmp_path.glob("staged*"))


def test_torchscript_export_of_a_gated_delta_net_names_the_other_exporter(tmp_path):
    checkpoint = tmp_path / "qwen3_5"
    build("qwen3_5").save_pretrained(checkpoint)
    output = tmp_path / "out"
    with pytest.raises(AtcError) as refused:
        export_checkpoint(ExportConfig(model=str(checkpoint), output=str(output), exporter="torchscript",
                                       with_past=True))
    assert refused.value.code == "E10055"
    assert "try --exporter dynamo" in str(refused.value) and "tensor_split" in refused.value.reason
    assert not output.exists()
