"""Simplified/SkipSimplifiedLayerNormalizationConversionPass on hand-built graphs, against onnxruntime's own
kernels for the two ops."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_layer_norms import ConvertSimplifiedLayerNorm, ConvertSkipSimplifiedLayerNorm

pytestmark = pytest.mark.unit

H = 16
RNG = np.random.default_rng(2)


def _model(shape=(2, 3, H), bias: bool = False, sum_output: bool = True, skip_shape=None, axis: int = -1,
           stats_output: str = ""):
    """x, skip → SkipSimplifiedLayerNormalization → y (and the sum) → SimplifiedLayerNormalization → z."""
    init = [numpy_helper.from_array((1 + 0.2 * RNG.standard_normal(H)).astype(np.float32), name)
            for name in ("gamma", "gamma2", "beta")]
    skip_inputs = ["x", "skip", "gamma"] + (["beta"] if bias else [])
    skip_outputs = ["y", "mean" if stats_output == "mean" else "", "", "sum" if sum_output else ""]
    while not skip_outputs[-1]:
        skip_outputs.pop()
    norm_outputs = ["z"] + (["inv_std_var"] if stats_output == "inv_std_var" else [])
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", skip_inputs, skip_outputs, name="skip_norm",
                              domain="com.microsoft", epsilon=1e-5),
             helper.make_node("SimplifiedLayerNormalization", ["y", "gamma2"], norm_outputs, name="norm", axis=axis,
                              epsilon=1e-6, stash_type=1)]
    outputs = ["z"] + (["sum"] if sum_output else []) + ([stats_output] if stats_output else [])
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
                     helper.make_tensor_value_info("skip", TensorProto.FLOAT, list(skip_shape or shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


PASSES = (ConvertSkipSimplifiedLayerNorm(), ConvertSimplifiedLayerNorm())


@pytest.mark.parametrize("options, expected", [
    ({}, {"AddRmsNorm": 1, "RmsNorm": 1}),
    (dict(sum_output=False), {"AddRmsNorm": 1, "RmsNorm": 1}),
    (dict(bias=True), {"Add": 2, "RmsNorm": 2}),
    (dict(shape=(6, H)), {"AddRmsNorm": 1, "RmsNorm": 1}),
], ids=["skip-sum", "skip-no-sum", "skip-bias", "tokens-by-hidden"])
def test_onnxruntime_norms_become_cann_norms(options, expected, tmp_path):
    model = _model(**options)
    fused, results = apply_pass(model, *PASSES)
    assert [r.effect_times for r in results] == [1, 1]
    counts = op_counts(fused)
    assert dict(counts) == expected
    shape = options.get("shape", (2, 3, H))
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32), "skip": RNG.standard_normal(shape).astype(np.float32)}
    assert_parity(model, fused, feeds, tmp_path, atol=2e-6)


@pytest.mark.parametrize("options, index, reason", [
    (dict(skip_shape=(1, 1, H)), 0, "is not the input's"),
    (dict(stats_output="mean"), 0, "mean or inv_std_var output is read"),
    (dict(stats_output="inv_std_var"), 1, "inv_std_var is read"),
    (dict(axis=1), 1, "not over the last axis alone"),
])
def test_refusals(options, index, reason):
    _, results = apply_pass(_model(**options), *PASSES)
    result = results[index]
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections
