"""Fused-op counts on every tiny export: what each family's recipe (cann_llm/models/recipes.py) says it must give."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import EXPORTS, export_id

from cann_llm.models.recipes import RECIPES
from cann_llm.runtime import load_artifact

LAYERS = 2


@pytest.mark.parametrize("case", EXPORTS, ids=export_id)
def test_fused_counts_follow_the_family_recipe(case, compiled):
    from cann_llm.models.tiny import tiny_onnx

    family, dynamo, with_past, attention = case
    loaded = load_artifact(compiled(tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention)))
    counts = Counter(node.op_type for node in loaded.model.graph.node)
    recipe = RECIPES[family]
    expected = recipe.expected_counts(LAYERS)
    assert counts["FusedAttention"] == expected["FusedAttention"]
    # every attention reads one packed q/k/v projection (split again before Qwen3's per-head norms)
    qkv = next(p for p in loaded.metadata["pass_report"]["passes"] if p["name"] == "QkvFusionPass")
    assert qkv["effect_times"] == expected["FusedAttention"]
    assert counts["RmsNorm"] + counts["AddRmsNorm"] == expected["norms"]
    assert counts["SwiGlu"] == expected["SwiGlu"]
    assert counts["MoE"] == expected["MoE"]
    if recipe.moe:
        # the routers' Softmax and TopK, and every per-token copy of the experts' weights, are in the MoE op
        assert counts["TopK"] == counts["GatherND"] == 0
        experts = {t.name for t in loaded.model.graph.initializer if len(t.dims) == 3}
        assert not [n.name for n in loaded.model.graph.node if n.op_type == "Gather" and n.input[0] in experts]
    assert counts["Softmax"] == (0 if recipe.attention else LAYERS)  # GPT-2's own
    if recipe.attention:
        # the mask construction and the head split/merge are gone with the attention (GLM's rotary
        # tables and MoE's experts keep Expands of their own)
        assert counts["Where"] == counts["Transpose"] == 0
    if recipe.norms_per_layer:
        assert counts["ReduceMean"] == 0 and counts["Sqrt"] == 0
    expected_family = "llama" if family in ("mistral", "llama_tied") else family
    assert loaded.metadata["model"]["detected_family"] == expected_family
