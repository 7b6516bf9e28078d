"""Sliding-window perplexity: one window equals Hugging Face's own loss; overlapping windows score every
token exactly once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import compile_to

from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.perplexity import perplexity


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def llama(tmp_path_factory, request):
    from cann_llm.models.tiny import build_tiny_model, tiny_onnx

    om = compile_to(tiny_onnx("llama", dynamo=True, with_past=True), tmp_path_factory.mktemp("ppl") / "m",
                    enable_paged_attention=request.param == "paged")
    return build_tiny_model("llama"), Executor(load_artifact(om))


def _hf_perplexity(model, ids: list[int]) -> float:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return math.exp(float(model(input_ids=tokens, labels=tokens).loss))


def test_one_window_equals_transformers_loss(llama):
    model, executor = llama
    ids = np.random.default_rng(0).integers(0, 256, 40).tolist()
    result = perplexity(executor, ids, window=64, stride=64)
    assert result.windows == 1 and result.tokens_scored == 39
    assert abs(result.perplexity - _hf_perplexity(model, ids)) < 1e-3 * result.perplexity


def test_sliding_windows_score_each_token_once_with_its_window_context(llama):
    model, executor = llama
    ids = np.random.default_rng(1).integers(0, 256, 100).tolist()
    result = perplexity(executor, ids, window=32, stride=16)
    assert result.tokens_scored == 99 and result.windows == 6
    total, scored_until = 0.0, 1
    for begin in range(0, 100, 16):
        end = min(begin + 32, 100)
        with torch.no_grad():
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids[begin:end]])).logits[0].double(), -1)
        for position in range(scored_until, end):
            total -= float(log_probs[position - 1 - begin, ids[position]])
        scored_until = end
        if end == 100:
            break
    assert abs(result.perplexity - math.exp(total / 99)) < 1e-3 * result.perplexity
    with pytest.raises(ValueError):
        perplexity(executor, ids, window=8, stride=9)
