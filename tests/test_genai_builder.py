"""onnxruntime-genai's model builder on the tiny Llama (fp32 and int4): its graph of onnxruntime contrib ops
compiles into the cann op set, contiguous and paged, and LLMEngine's greedy tokens are onnxruntime-genai's
own (its Generator, do_sample=False)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import compile_to, ort_reference
from generation_utils import mixed_prompts

from cann_llm import LLMEngine
from cann_llm.models.genai_builder import PRECISIONS, builder_available, genai_model
from cann_llm.models.tiny import TINY_FAMILIES
from cann_llm.runtime import Executor, load_artifact

pytestmark = pytest.mark.skipif(not builder_available(),
                                reason="onnxruntime-genai is not installed (pip install onnxruntime-genai; "
                                       "the project's test extras have it)")

LAYERS = TINY_FAMILIES["llama"].sizes["num_hidden_layers"]
KV_HEADS, HEAD_DIM = 2, 16
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=PRECISIONS)
def built(request):
    return genai_model(request.param), request.param


def _counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def test_the_builder_writes_contrib_ops(built):
    folder, precision = built
    counts = _counts(onnx.load(folder / "model.onnx", load_external_data=False))
    assert counts["GroupQueryAttention"] == LAYERS
    assert counts["SkipSimplifiedLayerNormalization"] == 2 * LAYERS and counts["SimplifiedLayerNormalization"] == 1
    assert counts["MatMulNBits"] == (5 * LAYERS + 1 if precision == "int4" else 0)  # qkv, o, gate, up, down; lm_head


def _feeds(tokens: list[int], past: dict[str, np.ndarray], cached: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, cached + len(tokens)), np.int64),
            **past}


def test_compiles_fused_and_matches_onnxruntime(built, tmp_path):
    folder, precision = built
    loaded = load_artifact(compile_to(folder / "model.onnx", tmp_path / "m"))
    counts = _counts(loaded.model)
    assert counts["FusedAttention"] == LAYERS
    assert counts["RmsNorm"] + counts["AddRmsNorm"] == 2 * LAYERS + 1
    # packed qkv, o, gate and up merged (SwiGlu), down; lm_head
    assert counts["MatMulInt4"] == (4 * LAYERS + 1 if precision == "int4" else 0) and counts["SwiGlu"] == LAYERS
    assert not any(node.domain == "com.microsoft" for node in loaded.model.graph.node)
    empty = {f"past_key_values.{i}.{kind}": np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)
             for i in range(LAYERS) for kind in ("key", "value")}
    prompt = _feeds([5, 17, 200, 33, 90, 7], empty, 0)
    expected_prompt = ort_reference(folder / "model.onnx", prompt)
    past = {f"past_key_values.{i}.{kind}": expected_prompt[f"present.{i}.{kind}"]
            for i in range(LAYERS) for kind in ("key", "value")}
    step = _feeds([42], past, 6)
    expected_step = ort_reference(folder / "model.onnx", step)
    for backend in ("onnxruntime", "reference"):
        executor = Executor(loaded, backend)
        for feeds, expected in ((prompt, expected_prompt), (step, expected_step)):
            got = executor.run(feeds)
            for name, value in expected.items():
                np.testing.assert_allclose(got[name], value, atol=1e-4, rtol=0, err_msg=f"{backend} {name}")


def _genai_greedy(folder, prompt: list[int]) -> list[int]:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    # min_length = max_length: every sequence runs its 32 tokens, eos or not
    params.set_search_options(do_sample=False, max_length=len(prompt) + NEW_TOKENS, min_length=len(prompt) + NEW_TOKENS)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt):]]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_engine_greedy_equals_genai(built, paged, tmp_path):
    folder, _ = built
    om = compile_to(folder / "model.onnx", tmp_path / "m", enable_paged_attention=paged)
    prompts = mixed_prompts(3, seed=7, high=40)
    expected = [_genai_greedy(folder, prompt) for prompt in prompts]
    with LLMEngine(om, max_batch_size=4, max_context_len=128, kv_cache_pages=16) as engine:
        assert engine.paged == paged
        requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        assert [request.output_ids for request in requests] == expected


def _float16_feeds(names: list[str], tokens: list[int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, len(tokens)), np.int64),
             "position_ids": np.arange(len(tokens))[None]}
    feeds.update({name: np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float16) for name in names if name.startswith("past")})
    return {name: feeds[name] for name in names}


def _logits_near_onnxruntime(source, loaded) -> None:
    """The artifact (float32 arithmetic) against onnxruntime running the float16 model: float16's precision,
    the same argmax at every position."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    tokens = [5, 17, 200, 33, 90, 7, 41, 12]
    want = session.run(["logits"], _float16_feeds([i.name for i in session.get_inputs()], tokens))[0].astype(np.float32)
    feeds = {name: value.astype(np.float32) if value.dtype == np.float16 else value
             for name, value in _float16_feeds(loaded.input_names, tokens).items()}
    got = Executor(loaded, "onnxruntime").run(feeds)["logits"]
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_gpu_float16_model_compiles_fused_in_float32_contiguous_and_paged(tmp_path, capsys):
    """`-p fp16 -e cuda`: GroupQueryAttention in float16, raised to float32 arithmetic (W10006) and fused."""
    from cann_llm.cli.atc import run

    source = genai_model("fp16", provider="cuda") / "model.onnx"
    assert _counts(onnx.load(source, load_external_data=False))["GroupQueryAttention"] == LAYERS
    capsys.readouterr()
    assert run([f"--model={source}", "--framework=5", f"--output={tmp_path / 'm'}", "--soc_version=Ascend910B"]) == 0
    assert "W10006: the model computes in float16" in capsys.readouterr().out
    loaded = load_artifact(tmp_path / "m.om")
    assert _counts(loaded.model)["FusedAttention"] == LAYERS
    _logits_near_onnxruntime(source, loaded)
    paged = load_artifact(compile_to(source, tmp_path / "paged", enable_paged_attention=True))
    assert _counts(paged.model)["PagedAttention"] == LAYERS


def test_the_cpu_float16_model_with_a_named_head_size_is_refused_until_given_one(tmp_path, capsys):
    """`-p fp16 -e cpu` (which the builder calls no valid CPU combination, and writes): MultiHeadAttention after
    separate RotaryEmbeddings does not convert, so nothing gives the cache's head size, which the export only
    names (`kv_cache_dim`): E10055 and no artifact, never one its runtime cannot load. With the size given by
    --input_shape it compiles, its unconverted attention counted by W10005, and runs."""
    from cann_llm.cli.atc import run

    source = genai_model("fp16") / "model.onnx"
    assert _counts(onnx.load(source, load_external_data=False))["MultiHeadAttention"] == LAYERS
    flags = [f"--model={source}", "--framework=5", f"--output={tmp_path / 'm'}", "--soc_version=Ascend910B"]
    capsys.readouterr()
    assert run(flags) != 0
    assert "E10055" in capsys.readouterr().out and not (tmp_path / "m.om").exists()
    shapes = ";".join(f"past_key_values.{i}.{kind}:-1,{KV_HEADS},-1,{HEAD_DIM}" for i in range(LAYERS)
                      for kind in ("key", "value"))
    assert run([*flags, f"--input_shape={shapes}"]) == 0
    assert f"W10005: {LAYERS} attention block(s)" in capsys.readouterr().out
    _logits_near_onnxruntime(source, load_artifact(tmp_path / "m.om"))
