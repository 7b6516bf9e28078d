"""Speculative decoding with a draft model (cann_llm/runtime/engine/draft_model.py) on tiny Llamas: the target's own
tokens whatever the draft, greedy and seeded (so sampled outputs are distributed as the target's alone),
drafts kept when the draft is the target itself, and drafts refused at load when they cannot serve."""

from __future__ import annotations

import json

import pytest
from conftest import compile_to
from generation_utils import mixed_prompts

from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.errors import AtcError


def _paged(tmp_path_factory, seed: int, page_size: int):
    from cann_llm.models.tiny import tiny_onnx

    folder = tmp_path_factory.mktemp(f"draft-s{seed}-p{page_size}")
    (folder / "paged.json").write_text(json.dumps({"page_size": page_size}))
    return compile_to(tiny_onnx("llama", dynamo=False, with_past=True, seed=seed), folder / "m",
                      enable_paged_attention=True, paged_config=str(folder / "paged.json"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _paged(tmp_path_factory, 0, 128)


@pytest.fixture(scope="module")
def itself(tmp_path_factory):
    """The target's own weights with 16-token pages: every greedy draft holds."""
    return _paged(tmp_path_factory, 0, 16)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """Other random weights of the same shape: drafts mostly rejected."""
    return _paged(tmp_path_factory, 1, 128)


def _outputs(om, prompts, params, **settings):
    with LLMEngine(om, max_context_len=256, kv_cache_pages=64, max_batch_size=8, speculative_max_batch=8,
                   **settings) as engine:
        outputs = engine.generate(prompts, params)
        return [[o.token_ids for o in output.outputs] for output in outputs], engine.stats


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=4, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_the_targets_own_tokens_whatever_the_draft(target, itself, stranger, params):
    prompts = mixed_prompts(3, seed=9, low=5, high=30)
    alone, _ = _outputs(target, prompts, params)
    for draft in (itself, stranger):
        drafted, stats = _outputs(target, prompts, params, draft_model=str(draft), num_speculative_tokens=4)
        assert drafted == alone and stats.draft_tokens > 0


def test_a_draft_that_is_the_target_itself_is_always_kept(target, itself):
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    _, stats = _outputs(target, mixed_prompts(2, seed=3, low=8, high=20), params, draft_model=str(itself),
                        num_speculative_tokens=4)
    assert stats.draft_tokens > 40 and stats.accepted_tokens == stats.draft_tokens


def test_drafts_that_cannot_serve_are_refused_at_load(target, tmp_path_factory):
    from cann_llm.models.tiny import tiny_onnx

    contiguous = compile_to(tiny_onnx("llama", dynamo=False, with_past=True), tmp_path_factory.mktemp("c") / "m")
    with pytest.raises(AtcError, match="paged KV cache"):
        LLMEngine(target, draft_model=str(contiguous), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(target, draft_model=str(target))
