"""MatMulNBitsConversionPass on hand-built MatMulNBits graphs, against onnxruntime's own kernel."""

from __future__ import annotations

import numpy as np
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.convert_matmul_nbits import ConvertMatMulNBits

pytestmark = pytest.mark.unit

N = 24
RNG = np.random.default_rng(3)


def _model(k: int = 64, block: int = 32, bits: int = 4, accuracy_level: int = 0, zero_points: str = "",
           bias: bool = False, flat_scales: bool = False, weight_input: bool = False, prepacked: int = 0):
    """x [2, 3, K] → MatMulNBits(random packed weight, scales[, zero points][, bias]) → y [2, 3, N]."""
    blocks = -(-k // block)
    weight = numpy_helper.from_array(RNG.integers(0, 256, (N, blocks, block * bits // 8), dtype=np.uint8), "weight")
    scales = (0.02 + 0.01 * RNG.random(N * blocks if flat_scales else (N, blocks))).astype(np.float32)
    init = [numpy_helper.from_array(scales, "scales")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])]
    if weight_input:
        inputs.append(helper.make_tensor_value_info("weight", TensorProto.UINT8, list(weight.dims)))
    else:
        init.append(weight)
    node_inputs = ["x", "weight", "scales"]
    if zero_points == "uint8":
        init.append(numpy_helper.from_array(RNG.integers(0, 256, (N, -(-blocks * bits // 8)), dtype=np.uint8), "zp"))
    elif zero_points == "float":
        init.append(numpy_helper.from_array(RNG.uniform(6, 9, (N, blocks)).astype(np.float32), "zp"))
    node_inputs.append("zp" if zero_points else "")
    if bias:
        init.append(numpy_helper.from_array(RNG.standard_normal(N).astype(np.float32), "bias"))
        node_inputs += ["", "bias"]
    while not node_inputs[-1]:
        node_inputs.pop()
    node = helper.make_node("MatMulNBits", node_inputs, ["y"], name="matmul", domain="com.microsoft", K=k, N=N,
                            bits=bits, block_size=block, accuracy_level=accuracy_level,
                            **({"weight_prepacked": prepacked} if prepacked else {}))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


VARIANTS = {
    "int4-block32": {},
    "int4-block16-zero-points-level4": dict(block=16, zero_points="uint8", accuracy_level=4),
    "int4-padded-last-block": dict(k=72),
    "int4-bias-flat-scales": dict(bias=True, flat_scales=True),
    "int8-level4": dict(bits=8, accuracy_level=4),
    "int8-block128-zero-points": dict(bits=8, k=128, block=128, zero_points="uint8"),
    "level2-as-level0": dict(accuracy_level=2),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_matmul_nbits_becomes_matmul_int4(variant, tmp_path):
    options = VARIANTS[variant]
    model = _model(**options)
    fused, (result,) = apply_pass(model, ConvertMatMulNBits())
    counts = op_counts(fused)
    assert (result.match_times, result.effect_times) == (1, 1), result.rejections
    assert counts["MatMulInt4"] == 1 and "MatMulNBits" not in counts and counts["Add"] == int(options.get("bias", False))
    (node,) = [n for n in fused.graph.node if n.op_type == "MatMulInt4"]
    level = next(a.i for a in node.attribute if a.name == "accuracy_level")
    assert level == (4 if options.get("accuracy_level") == 4 else 0)
    x = RNG.standard_normal((2, 3, options.get("k", 64))).astype(np.float32)
    assert_parity(model, fused, {"x": x}, tmp_path, atol=1e-4)


@pytest.mark.parametrize("options, reason", [
    (dict(bits=2, block=32), "2-bit"),
    (dict(prepacked=1), "prepacked"),
    (dict(zero_points="float"), "packed uint8"),
    (dict(weight_input=True), "not constants"),
])
def test_refusals(options, reason):
    _, (result,) = apply_pass(_model(**options), ConvertMatMulNBits())
    assert result.effect_times == 0 and any(reason in r for r in result.rejections), result.rejections
