"""A transformers model handed to `torch.onnx.export` itself, no wrapper, as users write it.

- dynamo, `torch.onnx.export(model, (input_ids,), kwargs={"attention_mask": ..., "use_cache": False},
  dynamo=True, dynamic_shapes=...)` with no `output_names`: the logits are named after the node that
  computed them (`linear_14`), and there is no `position_ids`. CausalLmIoNamingPass names them.
- TorchScript, `torch.onnx.export(model, (input_ids, attention_mask), dynamo=False, input_names=...,
  output_names=["logits"], dynamic_axes=...)` with `use_cache` off: the forward's `logits_to_keep=0`
  becomes a scalar input that picks one position's logits ([batch, vocab]). LogitsToKeepRemovalPass gives
  back every position's.

Each compiles paged and generates onnxruntime's greedy tokens on the export."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cann_llm import CompileConfig, compile_model
from cann_llm.models.tiny import build_tiny_model
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact
from tests.generation_utils import engine_greedy

VOCAB = 256


def _plain_export(family: str, path):
    ids = torch.randint(0, 200, (2, 8))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    torch.onnx.export(build_tiny_model(family).eval(), (ids,), str(path), dynamo=True,
                      kwargs={"attention_mask": torch.ones_like(ids), "use_cache": False},
                      dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
                                      "use_cache": None})
    return path


def _onnxruntime_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = list(prompt)
    for _ in range(new_tokens):
        feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
        ids.append(int(np.argmax(session.run(None, feeds)[0][0, -1])))
    return ids[len(prompt):]


def _torchscript_export(path, output_names: bool):
    model = build_tiny_model("llama").eval()
    model.config.use_cache = False
    ids = torch.randint(0, 200, (2, 8))
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    names = dict(output_names=["logits"], dynamic_axes={**axes, "logits": {0: "batch"}}) if output_names else \
        dict(dynamic_axes=axes)  # the output numbered by the exporter
    torch.onnx.export(model, (ids, torch.ones_like(ids)), str(path), dynamo=False, opset_version=17,
                      input_names=["input_ids", "attention_mask"], **names)
    return path


def _last_position_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime's greedy tokens on the TorchScript export, its logits_to_keep set to the last position."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = list(prompt)
    for _ in range(new_tokens):
        feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
                 "logits_to_keep": np.array(len(ids) - 1)}
        ids.append(int(np.argmax(session.run(None, feeds)[0][0])))
    return ids[len(prompt):]


@pytest.mark.parametrize("output_names", [True, False])
def test_a_torchscript_export_of_the_model_itself_gives_every_positions_logits(output_names, tmp_path):
    source = _torchscript_export(tmp_path / "model.onnx", output_names)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()][-1] == "logits_to_keep"  # the trace the test is about
    contiguous = compile_model(CompileConfig(model=str(source), framework=5, output=str(tmp_path / "contiguous"),
                                             soc_version="Ascend910B"))
    assert [t["name"] for t in contiguous.metadata["signature"]["inputs"]] == ["input_ids", "attention_mask"]
    assert [t["name"] for t in contiguous.metadata["signature"]["outputs"]] == ["logits"]
    ids = np.arange(3, 9)[None].repeat(2, 0)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    logits = Executor(load_artifact(contiguous.output)).run({"input_ids": ids, "attention_mask": mask})["logits"]
    assert logits.shape == (2, 6, VOCAB)
    for position in range(2, 6):  # each position's row is what the export gives when asked for that one
        feeds = {"input_ids": ids, "attention_mask": mask, "logits_to_keep": np.array(position)}
        np.testing.assert_allclose(logits[:, position], session.run(None, feeds)[0], atol=1e-5, rtol=0)
    paged = compile_model(CompileConfig(model=str(source), framework=5, output=str(tmp_path / "paged"),
                                        soc_version="Ascend910B", enable_paged_attention=True))
    prompts = [[5, 17, 99, 3], [42, 7, 1]]
    assert engine_greedy(paged.output, prompts, 12) == [_last_position_greedy(source, p, 12) for p in prompts]


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2"])  # rotary, rotary without position_ids, learned
def test_an_export_without_output_names_compiles_paged_and_generates(family, tmp_path):
    source = _plain_export(family, tmp_path / "model.onnx")
    output_name = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).get_outputs()[0].name
    assert output_name.startswith("linear")  # what the exporter names it; the test is moot if that changes
    result = compile_model(CompileConfig(model=str(source), framework=5, output=str(tmp_path / "paged"),
                                         soc_version="Ascend910B", enable_paged_attention=True))
    assert [t["name"] for t in result.metadata["signature"]["outputs"]] == ["logits"]
    assert result.metadata["model"]["num_layers"] == 2
    prompts = [[5, 17, 99, 3], [42, 7, 1]]
    assert engine_greedy(result.output, prompts, 12) == [_onnxruntime_greedy(source, p, 12) for p in prompts]
