"""RotaryEmbeddingExpansionPass on hand-built rotary ops (onnx's opset-23 one and onnxruntime's), against
onnxruntime; the expansion is what cann_llm/passes/match_rotary.py reads back."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.expand_rotary_embedding import ExpandRotaryEmbedding
from cann_llm.passes.match_rotary import match_rotary

pytestmark = pytest.mark.unit

B, H, S, D = 2, 3, 5, 16
RNG = np.random.default_rng(4)


def _model(domain: str = "", interleaved: int = 0, rotary_dim: int = 0, tables: str = "cache", rank: int = 4):
    """x [B, H, S, D] → RotaryEmbedding → y."""
    half = (rotary_dim or D) // 2
    angles = np.arange(32)[:, None] * (0.1 + np.arange(half))[None, :] * 0.07
    init = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
            numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    positions = [1] if tables == "offset" else [B, S]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, H, S, D] if rank == 4 else [B, S, H * D])]
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    if tables == "per-token":  # onnxscript's: the caches already read at each token, no position_ids
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, S, half]) for n in ("cos_bs", "sin_bs")]
        node_inputs = ["x", "cos_bs", "sin_bs"]
    else:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, positions))
        node_inputs = ["x", "position_ids", "cos", "sin"] if domain else ["x", "cos", "sin", "position_ids"]
    if rank == 3 or rotary_dim:
        attrs["num_heads"] = H
    node = helper.make_node("RotaryEmbedding", node_inputs, ["y"], name="rotary", domain=domain, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], init)
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def _feeds(tables: str = "cache", rotary_dim: int = 0, **_):
    half = (rotary_dim or D) // 2
    feeds = {"x": RNG.standard_normal((B, H, S, D)).astype(np.float32)}
    if tables == "per-token":
        angles = RNG.uniform(0, 3, (B, S, half))
        feeds.update(cos_bs=np.cos(angles).astype(np.float32), sin_bs=np.sin(angles).astype(np.float32))
    else:
        feeds["position_ids"] = np.array([4], np.int64) if tables == "offset" else \
            RNG.integers(0, 32, (B, S)).astype(np.int64)
    return feeds


VARIANTS = {
    "opset23-cache": {},
    "opset23-per-token": dict(tables="per-token"),
    "opset23-interleaved-partial": dict(interleaved=1, rotary_dim=8),
    "microsoft-positions": dict(domain="com.microsoft"),
    "microsoft-offset-partial": dict(domain="com.microsoft", tables="offset", rotary_dim=8),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rotary_ops_become_the_rotation_attention_fusion_reads(variant, tmp_path):
    options = VARIANTS[variant]
    model = _model(**options)
    expanded, (result,) = apply_pass(model, ExpandRotaryEmbedding())
    assert result.effect_times == 1 and "RotaryEmbedding" not in op_counts(expanded)
    graph = gs.import_onnx(expanded)
    found = match_rotary(graph.tensors()["y"])
    assert found is not None and found[0].name == "x"
    assert (found[1].rotary_dim, found[1].interleaved) == (options.get("rotary_dim") or D, options.get("interleaved", 0))
    assert_parity(model, expanded, _feeds(**options), tmp_path, atol=1e-5)


def test_a_rotation_of_unsplit_heads_stays():
    _, (result,) = apply_pass(_model(rank=3), ExpandRotaryEmbedding())
    assert result.effect_times == 0 and any("[B, H, S, D]" in r for r in result.rejections), result.rejections
