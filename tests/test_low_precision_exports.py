"""Models exported in bfloat16 or float16, as transformers 5 loads a checkpoint saved in them
(`from_pretrained`'s `dtype="auto"`), compile to float32 arithmetic (cann_llm/passes/upcast_float_compute.py): their
attention fuses, contiguous and paged, and the artifact computes what onnxruntime computes on the float32
export of the same weights (onnxruntime cannot run the bfloat16 export itself on a CPU). The weights stay
in the model's dtype unless `--precision_mode` asks otherwise; the compile says what it did (W10006)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from conftest import compile_to, ort_reference
from generation_utils import assert_paged_greedy_equals_onnxruntime

from cann_llm.models.tiny import TINY_FAMILIES
from cann_llm.runtime import Executor, load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs

LOW = {"bfloat16": onnx.TensorProto.BFLOAT16, "float16": onnx.TensorProto.FLOAT16}
CASES = [("llama", "bfloat16", True, True), ("qwen2", "bfloat16", True, False), ("llama", "float16", False, True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'dynamo' if c[2] else 'ts'}"
                                                             f"{'-kv' if c[3] else ''}")
def exports(request, tmp_path_factory):
    """(the export in the low dtype, the float32 export of the same weights, the dtype's name)."""
    import torch

    from cann_llm.models.export import export_causal_lm
    from cann_llm.models.tiny import build_tiny_model

    family, dtype, dynamo, with_past = request.param
    folder = tmp_path_factory.mktemp(f"{family}-{dtype}")
    model = build_tiny_model(family).to(getattr(torch, dtype))
    low = export_causal_lm(model, folder / "low" / "model.onnx", dynamo=dynamo, with_past=with_past)
    # the reference only: TorchScript writes the same arithmetic in a tenth of the dynamo exporter's time
    twin = export_causal_lm(model.float(), folder / "float32" / "model.onnx", dynamo=False, with_past=with_past)
    return low, twin, dtype


def _stored_types(loaded) -> Counter:
    """The element types of the artifact's 2-D float weights."""
    floats = {onnx.TensorProto.FLOAT, *LOW.values()}
    return Counter(t.data_type for t in loaded.model.graph.initializer if len(t.dims) == 2 and t.data_type in floats)


def test_compiles_fused_computing_what_onnxruntime_computes_on_the_float32_export(exports, tmp_path, capsys):
    from cann_llm.cli.atc import run

    low, twin, dtype = exports
    assert any(i.type.tensor_type.elem_type == LOW[dtype] for i in onnx.load(low).graph.output)
    capsys.readouterr()
    assert run([f"--model={low}", "--framework=5", f"--output={tmp_path / 'contiguous'}",
                "--soc_version=Ascend910B"]) == 0
    said = capsys.readouterr().out
    assert f"W10006: the model computes in {dtype}" in said and "W10005" not in said
    loaded = load_artifact(tmp_path / "contiguous.om")
    ops = Counter(n.op_type for n in loaded.model.graph.node)
    layers = TINY_FAMILIES["llama"].sizes["num_hidden_layers"]
    assert ops["FusedAttention"] == layers and ops["Softmax"] == 0
    # must_keep_origin_dtype: every 2-D weight (the linear layers, the embedding) stored as the model had it
    assert set(_stored_types(loaded)) == {LOW[dtype]}
    assert {v["dtype"] for v in loaded.metadata["signature"]["outputs"]} == {"float32"}
    feeds = causal_lm_inputs(loaded.metadata["signature"], loaded.metadata["model"], np.arange(3, 20)[None])
    want = ort_reference(twin, feeds)["logits"]
    for backend in ("onnxruntime", "reference"):
        np.testing.assert_allclose(Executor(loaded, backend).run(feeds)["logits"], want, atol=1e-4, rtol=0)


def test_paged_engine_generates_what_onnxruntime_does_on_the_float32_export(exports, tmp_path):
    low, twin, _ = exports
    assert_paged_greedy_equals_onnxruntime(twin, compile_to(low, tmp_path / "paged", enable_paged_attention=True))


def test_force_fp32_stores_the_weights_in_float32(exports, tmp_path):
    low, twin, _ = exports
    loaded = load_artifact(compile_to(low, tmp_path / "fp32", precision_mode="force_fp32"))
    assert set(_stored_types(loaded)) == {onnx.TensorProto.FLOAT}
