"""Greedy generation by LLMEngine equals transformers' greedy generate, token for token.

For every tiny family the fusion issue covers, both exporters, paged and contiguous artifacts: one
request alone, then 16 concurrent requests of different lengths (so each request's batch-mates and
chunking differ from its solo run); then both again with prompt-lookup drafts verified in every step.
"""

from __future__ import annotations

import pytest
from conftest import EXPORTS, export_id
from generation_utils import NEW_TOKENS, hf_greedy, mixed_prompts

from cann_llm import LLMEngine
from cann_llm.models.recipes import RECIPES
from cann_llm.models.tiny import TINY_FAMILIES

CASES = [(family, exporter, layout) for family in TINY_FAMILIES for exporter in RECIPES[family].exporters
         for layout in ("paged", "contiguous") if layout == "contiguous" or RECIPES[family].attention]


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
    for request in requests:
        request.result()
    return [request.output_ids for request in requests]


@pytest.mark.parametrize("family,exporter,layout", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_equals_transformers(family, exporter, layout, compiled):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=exporter == "dynamo", with_past=True)
    om = compiled(source, enable_paged_attention=layout == "paged")
    prompts = mixed_prompts(16)
    expected = hf_greedy(family, tuple(map(tuple, prompts)))
    for drafts in (0, 4):
        with LLMEngine(om, max_batch_size=16, max_context_len=256, kv_cache_pages=64, max_num_batched_tokens=96,
                       num_speculative_tokens=drafts, speculative_max_batch=16) as engine:
            assert _greedy(engine, prompts[:1]) == expected[:1]
            assert _greedy(engine, prompts) == expected
            assert engine.blocks.num_free == engine.blocks.num_pages
        assert engine.paged == (layout == "paged")
        assert (engine.stats.accepted_tokens > 0) == bool(drafts)


PAGED_EXPORTS = [case for case in EXPORTS if RECIPES[case[0]].attention]


@pytest.mark.parametrize("case", PAGED_EXPORTS, ids=export_id)
def test_every_export_compiles_paged_and_generates_as_transformers(case, compiled):
    """Each tiny export as users make them (sdpa or eager, either exporter, with or without a KV cache)
    compiles paged, and four concurrent requests generate transformers' greedy tokens (32 new)."""
    from cann_llm.models.tiny import tiny_onnx

    family, dynamo, with_past, attention = case
    om = compiled(tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention), enable_paged_attention=True)
    prompts = mixed_prompts(4, seed=5)
    expected = hf_greedy(family, tuple(map(tuple, prompts)), 32)
    with LLMEngine(om, max_batch_size=4, max_context_len=128, kv_cache_pages=32) as engine:
        assert engine.paged
        requests = [engine.submit(p, max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        assert [request.output_ids for request in requests] == expected


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_learned_position_table_ends_the_context(layout, compiled):
    """GPT-2 reads positions from a table (320 rows here, so not the 256-row token table): the artifact records
    it, and a sequence ends at it, whatever max_context_len asks (a request stops with finish_reason length,
    its tokens transformers' up to there, the last one sampled at the last row; a prompt that fills the table
    is refused)."""
    from cann_llm.runtime import load_artifact

    from cann_llm.models.tiny import tiny_onnx

    rows = 320
    overrides = {"n_positions": rows}
    om = compiled(tiny_onnx("gpt2", dynamo=True, with_past=True, overrides=overrides),
                  enable_paged_attention=layout == "paged")
    assert load_artifact(om).metadata["model"]["max_positions"] == rows
    prompt = (mixed_prompts(1, seed=3)[0] * 16)[:rows - 6]
    expected = hf_greedy("gpt2", (tuple(prompt),), 7, overrides)[0]
    with LLMEngine(om, max_context_len=4096, kv_cache_pages=16) as engine:
        assert engine.max_context_len == rows + 1
        request = engine.submit(prompt, max_new_tokens=100, temperature=0, ignore_eos=True)
        request.result()
        assert request.output_ids == expected and request.finish_reason == "length"
        with pytest.raises(ValueError, match=f"the prompt has {rows + 1} tokens; max_context_len is {rows + 1}"):
            engine.submit(list(prompt) + expected, max_new_tokens=1)
