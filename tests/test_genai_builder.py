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
from models.genai_builder import PRECISIONS, builder_available, genai_model
from models.tiny import TINY_FAMILIES
from runtime import Executor, load_artifact

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
    assert counts["MatMulInt4"] == (5 * LAYERS + 1 if precision == "int4" else 0)
    assert counts["SwiGlu"] == (0 if precision == "int4" else LAYERS)
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
