"""Merged weights cost no memory until written (cann_llm/passes/weight_memory.py): a merge of mapped weights is
deferred, reading it for a computation does not keep it, detaching hands the writer the deferred values,
and the artifact holds exactly the concatenation."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from cann_llm.passes.merge_weights import merge_weights, weight_source
from cann_llm.passes.weight_memory import Deferred, detach_weights, read_values
from cann_llm.runtime.artifact import OmFile, write_artifact


def test_a_merge_is_deferred_until_written(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((64, n)).astype(np.float32) for n in (32, 16, 16)]
    graph = gs.Graph()
    merged = merge_weights(graph, [weight_source(gs.Constant(f"w{i}", p)) for i, p in enumerate(parts)], "qkv")
    assert isinstance(merged._values, Deferred) and merged.shape == (64, 64) and merged.dtype == np.float32
    np.testing.assert_array_equal(read_values(merged), np.concatenate(parts, axis=1))
    assert isinstance(merged._values, Deferred)  # read for a computation, not kept

    x = gs.Variable("x", dtype=np.float32, shape=[1, 64])
    y = gs.Variable("y", dtype=np.float32, shape=[1, 64])
    graph = gs.Graph(nodes=[gs.Node("MatMul", inputs=[x, merged], outputs=[y])], inputs=[x], outputs=[y], opset=17)
    detached = detach_weights(graph)
    assert isinstance(detached["qkv"], Deferred)
    model = gs.export_onnx(graph, do_type_check=False)
    assert model.graph.initializer[0].data_location == TensorProto.EXTERNAL
    write_artifact(tmp_path / "m.om", model, {"signature": {"inputs": [], "outputs": []}}, detached=detached)
    om = OmFile(tmp_path / "m.om")
    np.testing.assert_array_equal(om.weights(om.graph())["qkv"], np.concatenate(parts, axis=1))


def test_a_graph_exported_as_it_is_gets_the_values():
    part = np.arange(8, dtype=np.float32).reshape(2, 4)
    constant = gs.Constant("w", Deferred((2, 8), np.float32, lambda: np.concatenate([part, part], axis=1)))
    x = gs.Variable("x", dtype=np.float32, shape=[1, 2])
    y = gs.Variable("y", dtype=np.float32, shape=[1, 8])
    model = gs.export_onnx(gs.Graph(nodes=[gs.Node("MatMul", inputs=[x, constant], outputs=[y])], inputs=[x],
                                    outputs=[y], opset=17), do_type_check=False)
    from onnx import numpy_helper

    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.concatenate([part, part], 1))
