"""A loop that TorchScript unrolled over data the traced input held: transformers' eager experts (Qwen2-MoE's
loop over the experts its tokens were routed to, the default of transformers 4.53-4.56) traced by
`torch.onnx.export(..., dynamo=False)` split NonZero's found experts into as many parts as the trace found,
so onnxruntime fails on the export itself when a step finds another number. `atc` says so: a paged compile is
refused (E10055) and a contiguous one warned (W10008), each naming the Split and the count; the same model
with the experts transformers 5 exports (`batched_mm`, the tiny fixtures' setting) is neither."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest

from cann_llm import CompileConfig, compile_model
from cann_llm.models.export import example_inputs, export_causal_lm
from cann_llm.models.tiny import build_tiny_model, tiny_onnx
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.errors import AtcError


@pytest.fixture(scope="module")
def eager_experts_export(tmp_path_factory):
    model = build_tiny_model("qwen2_moe")
    model.set_experts_implementation("eager")  # a Python loop over the experts hit
    path = tmp_path_factory.mktemp("traced") / "model.onnx"
    export_causal_lm(model, path, dynamo=False, with_past=False)
    return path


def _config(model, output, **flags):
    return CompileConfig(model=str(model), framework=5, output=str(output), soc_version="Ascend910B", **flags)


def test_the_export_itself_fails_where_a_step_finds_another_number_of_experts(eager_experts_export):
    # one token is routed to 2 of the 4 experts; the trace's batch hit more of them
    session = ort.InferenceSession(str(eager_experts_export), providers=["CPUExecutionProvider"])
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="split"):
        session.run(None, {"input_ids": np.array([[5]]), "attention_mask": np.ones((1, 1), np.int64),
                           "position_ids": np.zeros((1, 1), np.int64)})


def test_a_paged_compile_is_refused_naming_the_unrolled_split(eager_experts_export, tmp_path):
    with pytest.raises(AtcError) as error:
        compile_model(_config(eager_experts_export, tmp_path / "paged", enable_paged_attention=True))
    assert error.value.code == "E10055"
    found = re.search(r"the export unrolled a loop over what a NonZero finds: (\S+) splits what it found into (\d) "
                      r"parts \(and 1 more like it\)", error.value.message)
    assert found and found.group(1).endswith("Split") and int(found.group(2)) in (3, 4)
    assert not list(tmp_path.iterdir())


def test_a_contiguous_compile_warns_once(eager_experts_export, tmp_path):
    result = compile_model(_config(eager_experts_export, tmp_path / "contiguous"))
    assert [w[:6] for w in result.warnings if w.startswith("W10008")] == ["W10008"]
    assert "runs only on inputs that find exactly" in next(w for w in result.warnings if w.startswith("W10008"))
    # each unrolled copy of the experts fused into a node named after the same block: numbered apart, as
    # onnxruntime refuses two nodes of one name, so the artifact runs where the export does
    loaded = load_artifact(result.output)
    names = [node.name for node in loaded.model.graph.node]
    assert len(set(names)) == len(names) and sum(name.endswith("/SwiGlu_2") for name in names) > 0
    feeds = example_inputs(build_tiny_model("qwen2_moe").config, with_past=False)
    feeds = {name: value.numpy() for name, value in feeds.items()}
    want = ort.InferenceSession(str(eager_experts_export), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(Executor(loaded).run(feeds)["logits"], want, atol=1e-4, rtol=0)


def test_the_experts_transformers_5_exports_are_not_taken_for_a_traced_loop(tmp_path):
    source = tiny_onnx("qwen2_moe", dynamo=False, with_past=False)
    result = compile_model(_config(source, tmp_path / "paged", enable_paged_attention=True))
    assert not result.warnings
