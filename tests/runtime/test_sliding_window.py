"""Sliding-window attention (Mistral's): a window small enough to hide keys in these tests.

transformers' sliding-window cache keeps only the last W - 1 tokens, and its exports slice past and present
so; the fused op keeps the whole cache and hides old keys by its `sliding_window` attribute instead. Greedy
generation through LLMEngine, paged and contiguous, equals transformers' over prompts longer than W.
"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from conftest import compile_to
from generation_utils import hf_greedy, mixed_prompts

from cann_llm import LLMEngine
from cann_llm.runtime import load_artifact
from cann_llm.runtime.ops import ATTENTION_OPS

WINDOW = {"sliding_window": 8}
NEW_TOKENS = 32


def _windows(om) -> list[int]:
    nodes = [n for n in load_artifact(om).model.graph.node if n.op_type in ATTENTION_OPS]
    return [next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "sliding_window"), 0)
            for n in nodes]


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
@pytest.mark.parametrize("with_past,layout", [(True, "paged"), (True, "contiguous"), (False, "paged")],
                         ids=["kv-paged", "kv-contiguous", "nokv-paged"])
def test_a_sliding_window_generates_as_transformers_does(exporter, with_past, layout, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx("mistral", dynamo=exporter == "dynamo", with_past=with_past, overrides=WINDOW)
    om = compile_to(source, tmp_path / "m", enable_paged_attention=layout == "paged")
    assert _windows(om) == [8, 8]
    prompts = mixed_prompts(6, seed=3, low=10, high=40)
    expected = hf_greedy("mistral", tuple(map(tuple, prompts)), NEW_TOKENS, overrides=WINDOW)
    with LLMEngine(om, max_batch_size=6, max_context_len=128, kv_cache_pages=32, max_num_batched_tokens=64) as engine:
        requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        assert [request.output_ids for request in requests] == expected
    assert Counter(n.op_type for n in load_artifact(om).model.graph.node)["Softmax"] == 0


def test_the_default_window_is_kept_from_a_mistral_export(tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    for with_past in (True, False):
        om = compile_to(tiny_onnx("mistral", dynamo=True, with_past=with_past), tmp_path / f"m{with_past}")
        assert _windows(om) == [4096, 4096]
