"""Packed weights kept on disk until written (passes/weight_spill.py): a kept array is a read-only map of a
file in the spill's folder with the same values, small ones stay in memory, the quantizer's packed weights
are kept so during a compile, and the folder is gone when the compile ends, whether it wrote an artifact
or failed after packing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import compile_to
from onnx import TensorProto, helper, numpy_helper

from compiler.config import CompileConfig
from compiler.loader import import_graph
from compiler.pass_manager import run_passes
from compiler.pipeline import build_pipeline
from passes.weight_spill import SPILL_PREFIX, weight_spill
from runtime import load_artifact
from runtime.errors import AtcError


def test_a_kept_array_is_a_read_only_map_of_a_file_in_the_folder(tmp_path):
    values = np.random.default_rng(0).integers(0, 255, (300, 7), dtype=np.uint8)
    with weight_spill(tmp_path) as spill:
        kept = spill.keep(values)
        assert isinstance(kept, np.memmap) and not kept.flags.writeable
        assert Path(kept.filename).parent == spill.folder
        np.testing.assert_array_equal(kept, values)
        small = np.arange(10, dtype=np.float32)
        assert not isinstance(spill.keep(small), np.memmap)  # stored inline by the artifact anyway
        folder = spill.folder
    assert not folder.exists()
    np.testing.assert_array_equal(kept, values)  # the map outlives its file's name


def test_the_quantizer_keeps_its_packed_weights_in_the_spill(tiny_llama_path, tmp_path):
    cfg = CompileConfig(model=str(tiny_llama_path), framework=5, output=str(tmp_path / "m"), soc_version="Ascend910B",
                        enable_compress_weight=True)
    _, graph = import_graph(str(tiny_llama_path))
    with weight_spill(tmp_path) as spill:
        run_passes(graph, build_pipeline(cfg, spill=spill), cfg.fusion_switches)
        packed = [node.inputs[1] for node in graph.nodes if node.op == "MatMulInt4"]
        assert packed and all(isinstance(c.values, np.memmap) and Path(c.values.filename).parent == spill.folder
                              for c in packed)


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
