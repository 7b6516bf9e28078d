"""BatchedHeadsPass (cann_llm/passes/unfold_batched_heads.py) on BLOOM's spelling built by hand: q, k, v folded to
[B·H, ·, D], the scores scaled with a term added, unfolded for the softmax, the probabilities folded back
for the values. Each graph the pass rewrites computes what it did before (onnxruntime, both graphs)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.unfold_batched_heads import UnfoldBatchedHeads

pytestmark = pytest.mark.unit

B, H, S, D = 2, 4, 5, 8


def _bloom_like(term: np.ndarray, unfold=(B, H, S, S)) -> onnx.ModelProto:
    const = lambda name, values: numpy_helper.from_array(np.asarray(values), name)  # noqa: E731
    initializers = [const("fold", np.array([B * H, S, D], np.int64)), const("unfold", np.array(unfold, np.int64)),
                    const("probabilities_fold", np.array([B * H, S, S], np.int64)),
                    const("context_unfold", np.array([B, H, S, D], np.int64)), const("term", term.astype(np.float32)),
                    const("scale", np.array(0.35, np.float32))]
    nodes = [helper.make_node("Reshape", ["q", "fold"], ["qf"]), helper.make_node("Reshape", ["k", "fold"], ["kf"]),
             helper.make_node("Reshape", ["v", "fold"], ["vf"]),
             helper.make_node("Transpose", ["kf"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["qf", "kt"], ["scores"]), helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "term"], ["biased"]),
             helper.make_node("Reshape", ["biased", "unfold"], ["scores4"]),
             helper.make_node("Softmax", ["scores4"], ["probabilities"], axis=-1),
             helper.make_node("Reshape", ["probabilities", "probabilities_fold"], ["pf"]),
             helper.make_node("MatMul", ["pf", "vf"], ["context"]),
             helper.make_node("Reshape", ["context", "context_unfold"], ["out"])]
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [B, H, S, D]) for name in ("q", "k", "v", "out")]
    return helper.make_model(helper.make_graph(nodes, "g", io[:3], io[3:], initializers),
                             opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("term_shape, unfold, rewrites", [((B * H, 1, S), (B, H, S, S), 2), ((1, S, S), (B, H, S, S), 2),
                                                          ((B * H, 1, S), (H, B, S, S), 0)])
def test_folded_heads_unfold_and_compute_the_same(term_shape, unfold, rewrites):
    """A [B·H, 1, T] term (BLOOM's ALiBi) is viewed per head, a [1, S, T] one shared by all is kept as it
    is; scores unfolded heads first ([H, B, S, T]: not the fold's inverse) are left alone, and so is the
    context of probabilities whose second axis is not the values' heads."""
    rng = np.random.default_rng(0)
    model = _bloom_like(rng.standard_normal(term_shape), unfold)
    feeds = {name: rng.standard_normal((B, H, S, D)).astype(np.float32) for name in "qkv"}
    graph = gs.import_onnx(model)
    InferShapes().run(graph)
    assert UnfoldBatchedHeads().run(graph).effect_times == rewrites
    if rewrites:
        matmuls = [n for n in graph.nodes if n.op == "MatMul"]  # on q, kᵀ, p and v as they are: no fold read
        assert len(matmuls) == 2 and not any(t.inputs and t.inputs[0].op == "Reshape" for n in matmuls for t in n.inputs)
    np.testing.assert_allclose(_run(gs.export_onnx(graph), feeds), _run(model, feeds), atol=1e-6, rtol=0)
