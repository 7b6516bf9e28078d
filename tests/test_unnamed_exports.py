"""The plainest dynamo export of a transformers model, `torch.onnx.export(model, (input_ids,),
kwargs={"attention_mask": ..., "use_cache": False}, dynamo=True, dynamic_shapes=...)` with no
`output_names`: its logits are named after the node that computed them (`linear_14`), and it has no
`position_ids`. It compiles paged (CausalLmIoNamingPass names the logits) and generates onnxruntime's
greedy tokens on the export."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cann_llm import CompileConfig, compile_model
from models.tiny import build_tiny_model
from tests.generation_utils import engine_greedy


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
