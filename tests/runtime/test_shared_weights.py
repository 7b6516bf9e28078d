"""`share_weights`: onnxruntime's pre-packed weights saved once per machine (cann_llm/runtime/prepacked_cache.py) and
memory-mapped by every engine that serves the artifact: the same tokens as without, one cache entry per
session however many engines load it, the saved weights mapped rather than read, and an unwritable cache
leaving the weights unshared with a warning instead of failing the load."""

from __future__ import annotations

import pytest
from conftest import compile_to

from cann_llm.runtime.engine.engine import LLMEngine

PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 1, 250, 33]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_llama_path):
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("shared") / "m", enable_paged_attention=True,
                      enable_compress_weight=True)


def _tokens(om, **settings):
    with LLMEngine(om, max_context_len=64, kv_cache_pages=8, **settings) as engine:
        outputs = engine.generate(PROMPTS, max_new_tokens=10, temperature=0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in outputs], engine


def test_shared_weights_are_saved_once_and_mapped(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path / "cache"))
    alone, _ = _tokens(artifact)
    shared, engine = _tokens(artifact, share_weights=True)
    assert shared == alone
    entries = sorted((tmp_path / "cache" / "prepacked").iterdir())
    assert entries and all((entry / "model.data").stat().st_size > 0 for entry in entries)
    assert len(entries) == engine.runner.executor.num_segments
    again, _ = _tokens(artifact, share_weights=True)
    assert again == alone and sorted((tmp_path / "cache" / "prepacked").iterdir()) == entries
    with LLMEngine(artifact, max_context_len=64, kv_cache_pages=8, share_weights=True):
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
        assert all(str(entry / "model.data") in mapped for entry in entries)


def test_an_unwritable_cache_serves_unshared_with_a_warning(artifact, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CANN_LLM_CACHE", str(blocker / "cache"))
    alone, _ = _tokens(artifact)
    with caplog.at_level("WARNING", logger="cann_llm"):
        shared, _ = _tokens(artifact, share_weights=True)
    assert shared == alone
    assert any(r.getMessage().startswith("W13002: weights not shared") for r in caplog.records)
