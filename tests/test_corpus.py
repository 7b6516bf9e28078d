"""../shared/corpus: real exports made by others (transformers' default attention; PyTorch's TorchScript
and dynamo exporters and Optimum) fuse completely, reproduce their torch reference and generate through
the paged engine. Nothing here is keyed on their node names: they are what a user brings."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import compile_to
from generation_utils import assert_paged_greedy_equals_onnxruntime

from cann_llm.models.tiny import REPO_ROOT
from cann_llm.runtime import Executor, load_artifact

CORPUS = Path(os.environ.get("CANN_LLM_CORPUS", REPO_ROOT.parent / "shared" / "corpus"))
MODELS = sorted(p.name for p in CORPUS.iterdir() if (p / "model.onnx").is_file()) if CORPUS.is_dir() else []
TOLERANCE = 1e-4
NEW_TOKENS = 32


def _meta(name: str) -> dict:
    return json.loads((CORPUS / name / "meta.json").read_text())


def _cases(reference) -> list[tuple[dict, dict, np.ndarray]]:
    """(inputs, outputs, valid query rows) of the reference case and its second, differently shaped one."""
    cases = []
    for prefix in ("", "alt_"):
        inputs = {k[len(prefix) + 6:]: reference[k] for k in reference.files if k.startswith(prefix + "input.")}
        outputs = {k[len(prefix) + 7:]: reference[k] for k in reference.files if k.startswith(prefix + "output.")}
        cases.append((inputs, outputs, reference[prefix + "valid_query_rows"]))
    return cases


@pytest.mark.parametrize("name", MODELS)
def test_corpus_model_fuses_and_matches_its_torch_reference(name, tmp_path):
    meta = _meta(name)
    loaded = load_artifact(compile_to(CORPUS / name / "model.onnx", tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    expected = meta["expected"]
    # every layer's attention (a hybrid's recurrent layers have none: cann_llm/models/corpus_like.py's), but a
    # latent attention's, which fuses paged and runs as exported otherwise
    fused = expected.get("contiguous_attention_blocks", expected["attention_blocks"])
    assert counts["FusedAttention"] == fused <= expected["attention_blocks"] <= meta["num_layers"]
    # every RMSNorm fused, with the residual Add before it where there is one (Qwen3's q and k norms too);
    # a LayerNorm family keeps the export's LayerNormalization nodes, onnxruntime's own kernel
    assert counts["RmsNorm"] + counts["AddRmsNorm"] == expected.get("rmsnorm", 0)
    if "rmsnorm" not in expected:
        source = onnx.load(CORPUS / name / "model.onnx", load_external_data=False)
        layer_norms = Counter(node.op_type for node in source.graph.node)["LayerNormalization"]
        # two a layer and a final one, unless the corpus counted them (Phi-2's parallel block has one a layer)
        assert counts["LayerNormalization"] == layer_norms == expected.get("layernorm", 2 * meta["num_layers"] + 1)
    assert counts["Softmax"] == expected["attention_blocks"] - fused
    reference = np.load(CORPUS / name / "reference.npz")
    # what the export takes: TorchScript drops an input no op reads (Granite 4.0-H's position_ids)
    taken = {i.name for i in onnx.load(CORPUS / name / "model.onnx", load_external_data=False).graph.input}
    for backend in ("onnxruntime", "reference"):
        executor = Executor(loaded, backend)
        for inputs, outputs, valid in _cases(reference):
            got = executor.run({k: v for k, v in inputs.items() if k in taken})
            for output, expected in outputs.items():
                actual = got[output]
                if output == "logits":
                    actual, expected = actual[valid], expected[valid]
                np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE, err_msg=f"{backend} {output}")


def _skip_a_stateless_hybrid(source: Path) -> None:
    """A hybrid exported without its states (corpus_like's no-cache exports of Qwen3.5 or LFM2) runs contiguous
    only: its recurrence would mix a flattened batch's sequences, and a paged compile refuses it."""
    graph = onnx.load(source, load_external_data=False).graph
    if any(n.op_type in ("GatedDeltaNet", "CausalConvWithState") for n in graph.node) \
            and not any(i.name.startswith("past.") for i in graph.input):
        pytest.skip("a hybrid exported without its states runs contiguous only")


@pytest.mark.parametrize("name", MODELS)
def test_corpus_model_generates_through_the_paged_engine(name, tmp_path):
    source = CORPUS / name / "model.onnx"
    _skip_a_stateless_hybrid(source)
    om = compile_to(source, tmp_path / "m", enable_paged_attention=True)
    assert load_artifact(om).metadata["kv_cache"]["layout"] == "paged"
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)


@pytest.mark.parametrize("name", MODELS)
def test_corpus_model_generates_from_its_weights_in_28_bits(name, tmp_path):
    """`--compress_fp32_weight`: every float32 MatMul of the export stored in 28 bits, and the paged engine
    still generates onnxruntime's greedy tokens on the original export."""
    source = CORPUS / name / "model.onnx"
    _skip_a_stateless_hybrid(source)
    om = compile_to(source, tmp_path / "m", enable_paged_attention=True, compress_fp32_weight=True)
    graph = load_artifact(om).model.graph
    plain = load_artifact(compile_to(source, tmp_path / "plain", enable_paged_attention=True)).model.graph
    plain_weights = {t.name for t in plain.initializer}
    # each of the plain compile's weight MatMuls: at least one into a layer and one out of it (fused q/k/v and
    # o, the MLP's or a router; Nemotron-H's MLP blocks' up and down), and the head; a weight of a head each
    # (a latent attention's absorbed up-projection, [heads, rows, columns]) stays float32
    per_head = {t.name for t in plain.initializer if len(t.dims) == 3}
    weight_matmuls = [node for node in plain.node if node.op_type == "MatMul" and set(node.input) & plain_weights
                      and not set(node.input) & per_head]
    assert len(weight_matmuls) >= 2 * _meta(name)["num_layers"] + 1
    assert Counter(node.op_type for node in graph.node)["MatMulF28"] == len(weight_matmuls)
    # what stays a MatMul or Gemm multiplies activations (the rotary angles) or a weight of a head each, never a
    # matrix
    weights = {t.name for t in graph.initializer if len(t.dims) != 3}
    assert not [node for node in graph.node if node.op_type in ("MatMul", "Gemm") and set(node.input) & weights]
    assert_paged_greedy_equals_onnxruntime(source, om, NEW_TOKENS)
