"""Graphs that onnxruntime's transformer optimizer and onnxscript's rewriters have already fused compile into
the cann op set, contiguous and paged, and compute what onnxruntime computes on them.

The source is the tiny Llama's dynamo export with KV cache (transformers' default sdpa attention; the
TorchScript one for onnxruntime's own basic optimizations, saved by a session). On it,
`onnxruntime.transformers.optimizer` (model type gpt2, the one its Llama recipe uses) and onnxscript's
`optimize_for_ort` write SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization and leave the
attention as it is; onnxscript's opset-23 fusions write RMSNormalization and onnx's RotaryEmbedding on the
attention heads.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import compile_to, ort_reference
from generation_utils import assert_paged_greedy_equals_onnxruntime

from cann_llm.models.onnxruntime_quantizers import saved_by_a_session
from cann_llm.models.tiny import TINY_FAMILIES, tiny_onnx
from cann_llm.runtime import Executor, load_artifact

LAYERS = TINY_FAMILIES["llama"].sizes["num_hidden_layers"]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 64
NEW_TOKENS = 32


def _onnxruntime_optimizer(source: Path, target: Path) -> None:
    # its command line, as users run it (in a process of its own: its modules import a top-level
    # `fusion_utils`, which tests/fusion_utils.py would shadow here)
    subprocess.run([sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", str(source), "--output",
                    str(target), "--model_type", "gpt2", "--num_heads", str(HEADS), "--hidden_size", str(HIDDEN),
                    "--opt_level", "0"], check=True, capture_output=True, cwd=target.parent)


def _onnxscript_for_ort(source: Path, target: Path) -> None:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    fused, _ = optimize_for_ort(ir.serde.deserialize_model(onnx.load(source)))
    onnx.save(ir.serde.serialize_model(fused), target)


def _onnxscript_opset23(source: Path, target: Path) -> None:
    import onnx_ir as ir
    from onnx import version_converter
    from onnxscript.rewriter import onnx_fusions

    converted = ir.serde.deserialize_model(version_converter.convert_version(onnx.load(source), 23))
    onnx_fusions.fuse(converted)
    onnx.save(ir.serde.serialize_model(converted), target)


def _onnxruntime_basic(source: Path, target: Path) -> None:
    """The graph onnxruntime saves after its basic optimizations (`optimized_model_filepath`), of the
    TorchScript export: among them `Shape(Transpose(x, p))` becomes `Gather(Shape(x), p)`, which hid the
    rotary half-width a Gather further."""
    saved_by_a_session(tiny_onnx("llama", dynamo=False, with_past=True), target, "ORT_ENABLE_BASIC")


def _onnxruntime_extended(source: Path, target: Path) -> None:
    """After its extended optimizations: FusedMatMul (the scale in the scores' MatMul), QuickGelu (SiLU) and
    rotate_half's Slices as one Split, which OnnxRuntimeRewriteExpansionPass writes back."""
    saved_by_a_session(source, target, "ORT_ENABLE_EXTENDED")


def _onnxruntime_extended_torchscript(source: Path, target: Path) -> None:
    """The TorchScript export after the extended optimizations: also SimplifiedLayerNormalization in the
    default domain, past which onnx's shape inference knows nothing (only the symbolic one does), and every
    reshape target computed from shapes, which fold only once FusedMatMul no longer stops the symbolic one."""
    saved_by_a_session(tiny_onnx("llama", dynamo=False, with_past=True), target, "ORT_ENABLE_EXTENDED")


TOOLS = {
    "onnxruntime-optimizer": (_onnxruntime_optimizer, {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4}),
    "onnxscript-optimize_for_ort": (_onnxscript_for_ort, {"SimplifiedLayerNormalization": 1,
                                                          "SkipSimplifiedLayerNormalization": 4}),
    "onnxscript-opset23": (_onnxscript_opset23, {"RMSNormalization": 5, "RotaryEmbedding": 4}),
    "onnxruntime-basic": (_onnxruntime_basic, {"Constant": 0, "Shape": 20}),  # constants folded, Shapes shared
    "onnxruntime-extended": (_onnxruntime_extended, {"FusedMatMul": LAYERS, "QuickGelu": LAYERS}),
    "onnxruntime-extended-torchscript": (_onnxruntime_extended_torchscript,
                                         {"FusedMatMul": LAYERS, "QuickGelu": LAYERS,
                                          "SimplifiedLayerNormalization": 2 * LAYERS + 1}),
}


@pytest.fixture(scope="module", params=TOOLS)
def optimized(request, tmp_path_factory):
    """(path of the tool's output, the fused ops the tool wrote)."""
    tool, expected = TOOLS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "model.onnx"
    tool(tiny_onnx("llama", dynamo=True, with_past=True), path)
    return path, expected


def test_the_tools_write_fused_ops(optimized):
    path, expected = optimized
    counts = Counter(node.op_type for node in onnx.load(path).graph.node)
    assert {op: counts[op] for op in expected} == expected


def _feeds(batch: int = 2, past: int = 3, seq: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(3, 256, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64),
             "position_ids": np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)}
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


def test_compiles_fused_and_matches_onnxruntime(optimized, tmp_path):
    path, _ = optimized
    loaded = load_artifact(compile_to(path, tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    assert counts["FusedAttention"] == LAYERS and counts["RmsNorm"] + counts["AddRmsNorm"] == 2 * LAYERS + 1
    assert counts["Softmax"] == counts["RotaryEmbedding"] == 0
    assert not any(node.domain == "com.microsoft" for node in loaded.model.graph.node)
    feeds = _feeds()
    expected = ort_reference(path, feeds)
    for backend in ("onnxruntime", "reference"):
        got = Executor(loaded, backend).run(feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0, err_msg=f"{backend} {name}")


def test_paged_engine_greedy_equals_onnxruntime(optimized, tmp_path):
    path, _ = optimized
    om = compile_to(path, tmp_path / "m", enable_paged_attention=True)
    assert_paged_greedy_equals_onnxruntime(path, om, NEW_TOKENS)
