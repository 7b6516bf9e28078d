"""EngineConfig: the one home of the engine's defaults, taken by LLMEngine whole or field by field."""

from __future__ import annotations

import pytest
from conftest import compile_to

from cann_llm import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def contiguous_om(tmp_path_factory, tiny_llama_path):
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "llama")


def test_keywords_override_the_config_and_the_defaults_are_its(contiguous_om):
    with LLMEngine(contiguous_om, EngineConfig(max_batch_size=2, kv_cache_pages=8), max_context_len=256) as engine:
        assert engine.config == EngineConfig(max_batch_size=2, kv_cache_pages=8, max_context_len=256)
        assert engine.scheduler.max_batch_size == 2 and engine.blocks.num_pages == 2  # a slot per sequence
        assert engine.page_size == engine.max_context_len == 256
        assert engine.proposer.num_tokens == EngineConfig().num_speculative_tokens
        request = engine.submit([1, 2, 3], max_new_tokens=3, temperature=0, ignore_eos=True)
        request.result()
        assert len(request.output_ids) == 3


@pytest.mark.parametrize("settings, message", [(dict(max_batch_size=0), "max_batch_size"),
                                               (dict(max_context_len=1), "max_context_len"),
                                               (dict(backend="npu"), "backend")])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


@pytest.mark.parametrize("settings, message", [(dict(kv_cache_pages=3.5), "kv_cache_pages must be an integer, not float"),
                                               (dict(max_batch_size="8"), "max_batch_size must be an integer, not str"),
                                               (dict(enable_prefix_caching="0"), "enable_prefix_caching must be True or False"),
                                               (dict(chat_template_file=3), "chat_template_file must be a string")])
def test_settings_of_the_wrong_type_are_refused(settings, message):
    with pytest.raises(TypeError, match=message):
        EngineConfig(**settings)


def test_a_missing_chat_template_file_is_e13001_when_the_engine_is_made(contiguous_om, tmp_path):
    from cann_llm.runtime.errors import AtcError

    with pytest.raises(AtcError, match="E13001.*nope.jinja"):
        LLMEngine(contiguous_om, chat_template_file=tmp_path / "nope.jinja")


def test_an_unknown_setting_is_refused(contiguous_om):
    with pytest.raises(TypeError, match="max_batch"):
        LLMEngine(contiguous_om, max_batch=4)
