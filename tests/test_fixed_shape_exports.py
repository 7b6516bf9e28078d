"""Exports made without dynamic axes, the plainest `torch.onnx.export(model, (input_ids, mask), path)`: their
graph computes the one shape it was traced at (rotary tables, masks and reshapes are constants of that
length), so the compile says so (W10007), a paged compile is refused (E10055) and the engine refuses the
artifact (E10055), each naming the fixed shape; the artifact still computes that shape as the export does.
The re-export docs/exporting.md gives for it compiles paged and generates. Also: an artifact of a cache-less
export whose attention did not fuse generates (it recomputes the sequence each step)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cann_llm import CompileConfig, LLMEngine, compile_model
from cann_llm.models.tiny import build_tiny_model, tiny_onnx
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact
from tests.generation_utils import assert_paged_greedy_equals_onnxruntime, engine_greedy, ort_greedy

SHAPE = (1, 8)


class _TokensAndMask(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _export(path, dynamo: bool, dynamic: bool = False):
    ids = torch.randint(0, 200, SHAPE)
    kwargs = dict(input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamo=dynamo)
    if dynamic:  # the same export with its axes dynamic (the plain call docs/exporting.md gives: test_plain_exports.py)
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        kwargs["dynamic_shapes"] = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    if not dynamo:
        kwargs["opset_version"] = 17
    torch.onnx.export(_TokensAndMask(build_tiny_model("llama").eval()), (ids, torch.ones_like(ids)), str(path),
                      **kwargs)
    return path


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def fixed_export(request, tmp_path_factory):
    return _export(tmp_path_factory.mktemp("fixed") / "model.onnx", dynamo=request.param == "dynamo")


def _config(model, output, **flags):
    return CompileConfig(model=str(model), framework=5, output=str(output), soc_version="Ascend910B", **flags)


def test_a_paged_compile_of_a_fixed_shape_export_is_refused_naming_the_shape(fixed_export, tmp_path):
    with pytest.raises(AtcError) as error:
        compile_model(_config(fixed_export, tmp_path / "paged", enable_paged_attention=True))
    assert error.value.code == "E10055"
    assert "this export fixed input_ids at [1, 8]" in error.value.message
    assert not list(tmp_path.iterdir())


def test_a_fixed_shape_export_compiles_with_a_warning_and_the_engine_refuses_it(fixed_export, tmp_path):
    result = compile_model(_config(fixed_export, tmp_path / "fixed"))
    assert [w[:6] for w in result.warnings if w.startswith("W10007")] == ["W10007"]
    assert "fixed input_ids at [1, 8]" in next(w for w in result.warnings if w.startswith("W10007"))
    # the artifact computes its one shape as the export does
    feeds = {"input_ids": np.random.default_rng(3).integers(0, 200, SHAPE), "attention_mask": np.ones(SHAPE, np.int64)}
    expected = ort.InferenceSession(str(fixed_export), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    np.testing.assert_allclose(Executor(load_artifact(result.output)).run(feeds)["logits"], expected, atol=1e-4)
    with pytest.raises(AtcError) as error:
        LLMEngine(result.output, max_context_len=32, max_batch_size=1)
    assert error.value.code == "E10055"
    assert "takes input_ids of the one shape [1, 8] only, which its export fixed" in error.value.message


def test_fixing_input_ids_with_input_shape_is_named_when_the_engine_refuses(tmp_path):
    source = tiny_onnx("llama", dynamo=False, with_past=False)
    shape = {name: SHAPE for name in ("input_ids", "attention_mask", "position_ids")}
    result = compile_model(_config(source, tmp_path / "fixed", input_shape=shape))
    assert not [w for w in result.warnings if w.startswith("W10007")]  # asked for, not the export's doing
    with pytest.raises(AtcError) as error:
        LLMEngine(result.output, max_context_len=32, max_batch_size=1)
    assert error.value.code == "E10055" and "which atc's --input_shape fixed" in error.value.message


def test_the_documented_re_export_compiles_paged_and_generates(tmp_path):
    source = _export(tmp_path / "model.onnx", dynamo=True, dynamic=True)
    result = compile_model(_config(source, tmp_path / "paged", enable_paged_attention=True))
    # its only warning: exported here without a tokenizer, it takes token ids
    assert result.metadata["model"]["num_layers"] == 2 and [w[:6] for w in result.warnings] == ["W10009"]
    assert_paged_greedy_equals_onnxruntime(source, result.output, new_tokens=16)


def test_a_cache_less_export_whose_attention_did_not_fuse_generates(tmp_path):
    source = tiny_onnx("llama", dynamo=False, with_past=False)
    result = compile_model(_config(source, tmp_path / "unfused", optimization_switch="AttentionFusionPass:off"))
    assert [w[:6] for w in result.warnings] == ["W10005"]
    prompts = [[5, 17, 99, 3], [42, 7, 1]]
    assert engine_greedy(result.output, prompts, 12) == [ort_greedy(source, prompt, 12) for prompt in prompts]
