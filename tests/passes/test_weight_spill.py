"""Packed weights kept on disk until written (cann_llm/passes/weight_spill.py): kept arrays read back equal from one
file and hold no file descriptor, small ones stay in memory, a failed write is E13004, the quantizer's
packed weights are kept so during a compile, and the folder is gone when the compile ends, whether it
wrote an artifact or failed after packing."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from conftest import compile_to
from onnx import TensorProto, helper, numpy_helper

from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.loader import import_graph
from cann_llm.compiler.pass_manager import run_passes
from cann_llm.compiler.pipeline import build_pipeline
from cann_llm.passes.weight_memory import Deferred
from cann_llm.passes.weight_spill import SPILL_PREFIX, weight_spill
from cann_llm.runtime import load_artifact
from cann_llm.runtime.errors import AtcError


def test_kept_arrays_read_back_from_one_file_and_hold_no_descriptor(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, (300, 7 + i % 5), dtype=np.uint8) for i in range(300)]
    arrays.append(rng.standard_normal((40, 33)).astype(np.float32))
    descriptors = len(os.listdir("/proc/self/fd"))
    with weight_spill(tmp_path) as spill:
        kept = [spill.keep(a) for a in arrays]
        assert all(isinstance(k, Deferred) for k in kept)
        assert len(os.listdir("/proc/self/fd")) == descriptors  # 301 weights, no file left open or mapped
        for values, deferred in zip(arrays, kept):
            np.testing.assert_array_equal(deferred.load(), values)
        assert [p.name for p in spill.folder.iterdir()] == [spill.path.name]
        small = np.arange(10, dtype=np.float32)
        assert not isinstance(spill.keep(small), Deferred)  # stored inline by the artifact anyway
        folder = spill.folder
    assert not folder.exists()


def test_a_kept_weight_that_cannot_be_written_is_e13004(tmp_path):
    with weight_spill(tmp_path) as spill:
        spill.path.mkdir()  # where the file would go: opening it fails as a full or read-only disk would
        with pytest.raises(AtcError, match="E13004"):
            spill.keep(np.zeros(4096, np.uint8))


def test_the_quantizer_keeps_its_packed_weights_in_the_spill(tiny_llama_path, tmp_path):
    cfg = CompileConfig(model=str(tiny_llama_path), framework=5, output=str(tmp_path / "m"), soc_version="Ascend910B",
                        enable_compress_weight=True)
    _, graph = import_graph(str(tiny_llama_path))
    with weight_spill(tmp_path) as spill:
        run_passes(graph, build_pipeline(cfg, spill=spill), cfg.fusion_switches)
        packed = [node.inputs[1] for node in graph.nodes if node.op == "MatMulInt4"]
        assert packed and all(isinstance(c._values, Deferred) for c in packed)
        assert spill.path.stat().st_size >= sum(c._values.nbytes for c in packed)


def test_an_int4_compile_leaves_no_spill_and_equals_its_packed_weights(tiny_llama_path, tmp_path):
    om = compile_to(tiny_llama_path, tmp_path / "int4", enable_compress_weight=True)
    assert not list(tmp_path.glob(f"{SPILL_PREFIX}*"))
    loaded = load_artifact(om)
    matmuls = [n for n in loaded.model.graph.node if n.op_type == "MatMulInt4"]
    assert matmuls and all(loaded.weights[n.input[1]].dtype == np.uint8 for n in matmuls)


def test_a_compile_failing_after_packing_leaves_no_spill(tmp_path):
    rng = np.random.default_rng(1)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "plain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
                              [numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w")])
    source = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    # --auto_tune_mode is refused for a model without input_ids and logits once the passes have packed w
    with pytest.raises(AtcError, match="E10055"):
        compile_to(source, tmp_path / "plain", enable_compress_weight=True, auto_tune_mode="GA")
    assert not list(tmp_path.glob(f"{SPILL_PREFIX}*")) and not (tmp_path / "plain.om").exists()
