"""Fused-op counts on every tiny export: what the fusion issue's recipe says each family must give."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import EXPORTS, compile_to, export_id
from runtime import load_artifact

LAYERS = 2


@pytest.mark.parametrize("case", EXPORTS, ids=export_id)
def test_every_rms_norm_is_fused(case, tmp_path):
    from models.tiny import tiny_onnx

    family, dynamo, with_past = case
    loaded = load_artifact(compile_to(tiny_onnx(family, dynamo=dynamo, with_past=with_past), tmp_path / "m"))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    assert counts["RmsNorm"] == 1  # the first layer's input norm reads the embeddings, not a residual sum
    assert counts["AddRmsNorm"] == 2 * LAYERS
    assert counts["ReduceMean"] == 0 and counts["Sqrt"] == 0
    assert counts["SwiGlu"] == LAYERS and counts["Sigmoid"] == 0
    assert counts["FusedAttention"] == LAYERS and counts["Softmax"] == 0
    # the mask construction, the head split/merge and the KV repetition are gone with the attention
    assert counts["Where"] == counts["Expand"] == counts["Transpose"] == counts["Reshape"] == 0
    passes = {p["name"]: p for p in loaded.metadata["pass_report"]["passes"]}
    assert passes["RmsNormFusionPass"]["effect_times"] == 2 * LAYERS + 1
    assert passes["AddRmsNormFusionPass"]["effect_times"] == 2 * LAYERS
