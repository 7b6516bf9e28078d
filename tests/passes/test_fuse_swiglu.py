"""SwiGluFusionPass: separate gate/up projections merged, fused gate_up cut by Split or Slices, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.canonicalize_gemm import CanonicalizeGemm
from cann_llm.passes.fuse_swiglu import FuseSwiGlu

pytestmark = pytest.mark.unit

H, WIDE = 16, 24
RNG = np.random.default_rng(1)
FEEDS = {"x": RNG.standard_normal((2, 3, H)).astype(np.float32)}


def _model(nodes, opset=17, extra=()):
    initializers = [numpy_helper.from_array(0.25 * RNG.standard_normal((H, WIDE)).astype(np.float32), "wg"),
                    numpy_helper.from_array(0.25 * RNG.standard_normal((H, WIDE)).astype(np.float32), "wu"),
                    numpy_helper.from_array(0.25 * RNG.standard_normal((H, 2 * WIDE)).astype(np.float32), "wgu"),
                    numpy_helper.from_array(0.25 * RNG.standard_normal((WIDE, H)).astype(np.float32), "wd"),
                    numpy_helper.from_array(np.array([WIDE, WIDE], np.int64), "halves"),
                    *[numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
                      (("zero", 0), ("mid", WIDE), ("end", 2 * WIDE), ("last", -1))]]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", *extra)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, H])],
                              outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _silu_product(gate="g", up="u", sig_first=False, up_first=False):
    return [helper.make_node("Sigmoid", [gate], ["s"]),
            helper.make_node("Mul", ["s", gate] if sig_first else [gate, "s"], ["silu"]),
            helper.make_node("Mul", [up, "silu"] if up_first else ["silu", up], ["h"]),
            helper.make_node("MatMul", ["h", "wd"], ["y"])]


SEPARATE = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu"], ["u"])]
FUSED = [helper.make_node("MatMul", ["x", "wgu"], ["gu"])]
CASES = {
    "separate": SEPARATE + _silu_product(),
    "separate-commuted": SEPARATE + _silu_product(sig_first=True, up_first=True),
    "split": FUSED + [helper.make_node("Split", ["gu", "halves"], ["g", "u"], axis=-1)] + _silu_product(),
    "slices": FUSED + [helper.make_node("Slice", ["gu", "zero", "mid", "last"], ["g"]),
                       helper.make_node("Slice", ["gu", "mid", "end", "last"], ["u"])] + _silu_product(),
}


@pytest.mark.parametrize("case", CASES)
def test_gated_silu_becomes_one_swiglu(case, tmp_path):
    model = _model(CASES[case])
    fused, (result,) = apply_pass(model, FuseSwiGlu())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1)
    assert counts["SwiGlu"] == 1 and counts["MatMul"] == 2
    assert not {"Sigmoid", "Split", "Slice"} & set(counts)
    assert_parity(model, fused, FEEDS, tmp_path)


@pytest.mark.parametrize("nodes, extra, reason", [
    ([helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("Relu", ["x"], ["x2"]),
      helper.make_node("MatMul", ["x2", "wu"], ["u"])] + _silu_product(), (), "different inputs"),
    (FUSED + [helper.make_node("Slice", ["gu", "mid", "end", "last"], ["g"]),
              helper.make_node("Slice", ["gu", "zero", "mid", "last"], ["u"])] + _silu_product(), (), "halves"),
    (SEPARATE + _silu_product(), ("g",), "other readers"),
    (SEPARATE + [helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["u", "s"], ["silu"]),
                 helper.make_node("Mul", ["silu", "u"], ["h"]), helper.make_node("MatMul", ["h", "wd"], ["y"])],
     (), "SiLU"),
])
def test_refusals(nodes, extra, reason):
    fused, (result,) = apply_pass(_model(nodes, extra=extra), FuseSwiGlu())
    assert result.effect_times == 0 and "SwiGlu" not in op_counts(fused)
    assert any(reason in r for r in result.rejections), result.rejections


def _slices(gate_bounds, up_bounds, axes="last", steps=None):
    def bounds(values, label):
        return numpy_helper.from_array(np.array(values, np.int64), label)

    nodes = FUSED + [helper.make_node("Slice", ["gu", "gs", "ge", axes] + (["st"] if steps else []), ["g"]),
                     helper.make_node("Slice", ["gu", "us", "ue", axes] + (["st"] if steps else []), ["u"])]
    extra = [bounds([gate_bounds[0]], "gs"), bounds([gate_bounds[1]], "ge"), bounds([up_bounds[0]], "us"),
             bounds([up_bounds[1]], "ue"), bounds([1], "axis1"), bounds([steps or 1], "st")]
    return nodes + _silu_product(), extra


@pytest.mark.parametrize("case, reason", [
    ("constant-up", "not multiplied by an up projection"),
    ("variable-weight", "one shape and kind"),
    ("up-read-twice", "up projection has other readers"),
    ("split-axis", "not in two along the last axis"),
    ("split-reversed", "up half comes first"),
    ("split-unequal", "halves differ"),
    ("not-halves", "neither MatMuls nor halves"),
    ("slice-step", "has a step"),
    ("slice-axis", "not on the last axis"),
])
def test_more_refusals(case, reason):
    extra_outputs, extra_init, extra_inputs = (), [], []
    if case == "constant-up":
        nodes = SEPARATE[:1] + _silu_product(up="wd_row")
        extra_init = [numpy_helper.from_array(np.ones(WIDE, np.float32), "wd_row")]
    elif case == "variable-weight":
        nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu_in"], ["u"])]
        nodes += _silu_product()
        extra_inputs = [helper.make_tensor_value_info("wu_in", TensorProto.FLOAT, [H, WIDE])]
    elif case == "up-read-twice":
        nodes, extra_outputs = SEPARATE + _silu_product(), ("u",)
    elif case.startswith("split"):
        outputs = ["u", "g"] if case == "split-reversed" else ["g", "u"]
        sizes = "uneven" if case == "split-unequal" else "halves"
        nodes = FUSED + [helper.make_node("Split", ["gu", sizes], outputs, axis=1 if case == "split-axis" else -1)]
        nodes += _silu_product()
        extra_init = [numpy_helper.from_array(np.array([WIDE - 8, WIDE + 8], np.int64), "uneven")]
    elif case == "not-halves":
        nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu"], ["u0"]),
                 helper.make_node("Relu", ["u0"], ["u"])] + _silu_product()
    else:
        nodes, extra_init = _slices((0, WIDE), (WIDE, 2 * WIDE), "axis1" if case == "slice-axis" else "last",
                                    2 if case == "slice-step" else None)
    model = _model(nodes, extra=extra_outputs)
    model.graph.initializer.extend(extra_init)
    model.graph.input.extend(extra_inputs)
    fused, (result,) = apply_pass(model, FuseSwiGlu())
    assert result.effect_times == 0 and "SwiGlu" not in op_counts(fused)
    assert any(reason in r for r in result.rejections), result.rejections


def _gemm_model(**gate_attrs):
    """A 2-D MLP as dynamo writes one (Qwen2-MoE's shared expert): Gemm projections, gate with transB."""
    initializers = [numpy_helper.from_array(0.25 * RNG.standard_normal((WIDE, H)).astype(np.float32), "wg_t"),
                    numpy_helper.from_array(0.25 * RNG.standard_normal((H, WIDE)).astype(np.float32), "wu"),
                    numpy_helper.from_array(0.25 * RNG.standard_normal((WIDE, H)).astype(np.float32), "wd")]
    nodes = [helper.make_node("Gemm", ["x", "wg_t"], ["g"], transB=1, **gate_attrs),
             helper.make_node("Gemm", ["x", "wu"], ["u"])] + _silu_product()
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("gate_attrs", [{}, {"alpha": 2.0}], ids=["plain", "scaled"])
def test_gemm_projections_merge_like_matmuls_once_canonical(gate_attrs, tmp_path):
    model = _gemm_model(**gate_attrs)
    fused, (canonical, result) = apply_pass(model, CanonicalizeGemm(), FuseSwiGlu())
    assert canonical.effect_times == 2 and result.effect_times == 1
    assert op_counts(fused) == {"MatMul": 2, "SwiGlu": 1}
    assert_parity(model, fused, {"x": RNG.standard_normal((6, H)).astype(np.float32)}, tmp_path)
