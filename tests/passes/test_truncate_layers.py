"""LayerTruncationPass (`atc --keep_layers=N`): a 3-layer tiny model cut to its first layers generates what
transformers' own model does with the later layers removed, across the spellings that matter (Qwen3's
per-head q/k norms, Gemma's scaled embedding, GPT-2's LayerNorm, both exporters), and what cannot be
truncated is refused with a code."""

from __future__ import annotations

import pytest
from conftest import compile_to

from cann_llm.compiler.config import CompileConfig
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.errors import AtcError

LAYERS = {"num_hidden_layers": 3}
PROMPT = [5, 17, 99, 3, 42, 8, 200, 31]
NEW_TOKENS = 12


def _export(family: str, dynamo: bool):
    from cann_llm.models.tiny import tiny_onnx

    overrides = {"n_layer": 3} if family == "gpt2" else LAYERS
    return tiny_onnx(family, dynamo=dynamo, with_past=True, overrides=overrides), overrides


def _truncated_reference(family: str, overrides: dict, keep: int) -> list[int]:
    """transformers' greedy tokens from the same weights with every layer past `keep` removed."""
    import torch

    from cann_llm.models.tiny import build_tiny_model

    model = build_tiny_model(family, overrides=overrides)
    if family == "gpt2":
        model.transformer.h = model.transformer.h[:keep]
        model.config.n_layer = keep
    else:
        model.model.layers = model.model.layers[:keep]
        model.config.num_hidden_layers = keep
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:keep]
    with torch.no_grad():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return ids[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("family,dynamo,keep,paged", [("llama", True, 2, True), ("qwen3", True, 1, True),
                                                      ("gemma", False, 2, True), ("gpt2", False, 1, False)])
def test_the_first_layers_and_the_head_generate_as_the_truncated_model(tmp_path, family, dynamo, keep, paged):
    model, overrides = _export(family, dynamo)
    om = compile_to(model, tmp_path / "draft", keep_layers=keep, enable_paged_attention=paged)
    metadata = OmFile(om).metadata
    assert metadata["model"]["num_layers"] == keep
    truncation = next(p for p in metadata["pass_report"]["passes"] if p["name"] == "LayerTruncationPass")
    assert (truncation["match_times"], truncation["effect_times"]) == (3, 3 - keep)
    with LLMEngine(om, max_context_len=128, kv_cache_pages=8) as engine:
        output = engine.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert list(output[0].outputs[0].token_ids) == _truncated_reference(family, overrides, keep)


def test_a_model_of_onnxruntimes_4_bit_matmuls_is_cut_too(tmp_path):
    """MatMulNBitsQuantizer's model: its lm_head a MatMulInt4, whose packed weight is [N, blocks, bytes]."""
    from cann_llm.models.onnxruntime_quantizers import matmul_nbits

    model, _ = _export("llama", dynamo=True)
    om = compile_to(matmul_nbits(model, tmp_path / "int4.onnx"), tmp_path / "draft", keep_layers=1,
                    enable_paged_attention=True)
    metadata = OmFile(om).metadata
    truncation = next(p for p in metadata["pass_report"]["passes"] if p["name"] == "LayerTruncationPass")
    assert metadata["model"]["num_layers"] == 1 and (truncation["match_times"], truncation["effect_times"]) == (3, 2)


def test_the_removed_layers_cache_inputs_and_outputs_are_gone(tmp_path):
    model, _ = _export("llama", True)
    om = compile_to(model, tmp_path / "draft", keep_layers=1)
    signature = OmFile(om).metadata["signature"]
    names = {value["name"] for value in (*signature["inputs"], *signature["outputs"])}
    assert {"past_key_values.0.key", "present.0.value"} <= names
    assert not any(".1." in name or ".2." in name for name in names)


def test_what_cannot_be_truncated_is_refused(tmp_path):
    model, _ = _export("llama", True)
    with pytest.raises(AtcError, match="E10001.*The model has 3 layers"):
        compile_to(model, tmp_path / "all", keep_layers=3)
    with pytest.raises(AtcError, match="E10001.*whole number"):
        CompileConfig.from_flags(model=str(model), framework="5", output=str(tmp_path / "x"),
                                 soc_version="Ascend910B", keep_layers="two")
    switches = tmp_path / "switches.cfg"
    switches.write_text("AttentionFusionPass:off\nAttentionConversionPass:off\n")
    with pytest.raises(AtcError, match="E10055.*no attention fused"):
        compile_to(model, tmp_path / "unfused", keep_layers=1, fusion_switch_file=str(switches))
    assert not (tmp_path / "all.om").exists() and not (tmp_path / "unfused.om").exists()
