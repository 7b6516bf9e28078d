"""Staged calibration: the same statistics as one run of the whole graph, one MatMul input at a time."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.cli.quant import fused_graph
from cann_llm.compiler.config import CompileConfig
from cann_llm.passes.quant.calibration import collect_input_statistics
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.staged_calibration import StagedStatistics


@pytest.mark.parametrize("family, dynamo", [("qwen2", False), ("qwen2", True), ("glm", True), ("phi3", False),
                                           ("gemma", True), ("qwen2_moe", False), ("qwen2_moe", True), ("gpt2", False)])
def test_staged_statistics_equal_the_whole_graph_run_and_are_released(tmp_path, family, dynamo):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=dynamo, with_past=True)
    graph = fused_graph(CompileConfig(model=str(source), framework=5, output=str(tmp_path / "m"),
                                      soc_version="Ascend910B", quantization=QuantConfig(method="gptq")))
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 256, 48) for _ in range(3)]
    names = [n.inputs[0].name for n in graph.nodes if n.op == "MatMul"]
    whole = collect_input_statistics(graph, sorted(set(names)), samples)
    staged = StagedStatistics(graph, samples)
    for name in names:  # in model order, as the quantizer asks
        stats = staged.get(name)
        np.testing.assert_allclose(stats.hessian, whole[name].hessian, rtol=1e-5, atol=1e-5 * np.abs(stats.hessian).max())
        np.testing.assert_allclose(stats.mean_abs, whole[name].mean_abs, rtol=1e-5)
        assert stats.rows == whole[name].rows
        staged.pop(name)
        assert not staged._statistics  # nothing is held beyond the layer being quantized
    assert staged.get("no such tensor") is None
