"""`atc --auto_tune_mode`: a measured search of the engine's settings on this machine, recorded in the artifact
with every trial and the effect against the defaults; the engine starts from the recorded settings, anything
given explicitly (Python or command line) wins; and the search's rules (a choice kept only when at least as
fast as the defaults in both rates) hold on what was recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import compile_to

from cann_llm.cli.llm_commands import given
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.engine.config import EngineConfig
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.engine.tuning import TUNABLE, tuned_settings
from cann_llm.runtime.errors import AtcError


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_llama_path):
    """Compiled with a relative --output, as from a shell in its folder: the trials run from elsewhere."""
    folder, before = tmp_path_factory.mktemp("tuned"), os.getcwd()
    os.chdir(folder)
    try:
        return folder / compile_to(tiny_llama_path, Path("m"), enable_paged_attention=True,
                                   enable_compress_weight=True, auto_tune_mode="RL,GA")
    finally:
        os.chdir(before)


def test_the_search_is_recorded_with_its_trials_and_effect(tuned):
    tuning = OmFile(tuned).metadata["tuning"]
    trials = tuning["trials"]
    assert trials[0]["settings"] == {} and all(t["decode_tok_s"] > 0 and t["prefill_tok_s"] > 0 for t in trials)
    tried = [key for t in trials for key in t["settings"]]
    assert {"native_matmul", "max_num_batched_tokens"} <= set(tried) <= set(TUNABLE)
    assert set(tuning["effect"]) == {"decode", "prefill"} and tuning["host"]["cores"] >= 1
    # kept only when the confirmation found it at least as fast as the defaults in both rates
    if tuning["settings"]:
        assert tuning["settings"] == tuning["searched"] and min(tuning["effect"].values()) >= 1.0
    else:
        assert tuning["searched"] == {} or min(tuning["effect"].values()) < 1.0


def test_the_engine_starts_from_the_recorded_settings_and_explicit_ones_win(tuned, tmp_path):
    from cann_llm.runtime.artifact import write_artifact

    om = OmFile(tuned)
    model, metadata = om.graph(), om.metadata
    metadata["tuning"]["settings"] = {"max_num_batched_tokens": 256, "native_matmul": False}
    edited = tmp_path / "edited.om"
    write_artifact(edited, model, metadata, om.tokenizer_files(), detached=om.weights(model))
    assert tuned_settings(OmFile(edited).metadata) == {"max_num_batched_tokens": 256, "native_matmul": False}
    with LLMEngine(edited, max_context_len=64, kv_cache_pages=8) as engine:
        assert (engine.config.max_num_batched_tokens, engine.config.native_matmul) == (256, False)
    with LLMEngine(edited, max_context_len=64, kv_cache_pages=8, max_num_batched_tokens=128) as engine:
        assert (engine.config.max_num_batched_tokens, engine.config.native_matmul) == (128, False)
    with LLMEngine(edited, EngineConfig(max_context_len=64, kv_cache_pages=8)) as engine:  # a config is explicit
        assert engine.config.max_num_batched_tokens == EngineConfig.max_num_batched_tokens


def test_the_command_line_passes_only_what_was_given():
    import click
    from click.testing import CliRunner

    seen = {}

    @click.command()
    @click.option("--max_num_batched_tokens", type=int, default=512)
    @click.option("--threads", type=int, default=None)
    def command(**settings):
        seen.update(given(settings))

    CliRunner().invoke(command, ["--threads", "1"], catch_exceptions=False)
    assert seen == {"threads": 1}


def test_auto_tune_needs_a_causal_lm(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "plain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    source = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    with pytest.raises(AtcError, match="E10055.*auto_tune_mode"):
        compile_to(source, tmp_path / "plain", auto_tune_mode="GA")
    assert not (tmp_path / "plain.om").exists()
