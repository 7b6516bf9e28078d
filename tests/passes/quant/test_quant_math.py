"""Block-wise quantization arithmetic: ranges, round trip within half a step, short last blocks, MatMulNBits
packing and the kernels that read it."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from cann_llm.passes.quant.math import quantize_blockwise, split_float_zeros
from cann_llm.passes.quant.search import gptq_quantize
from cann_llm.runtime.kernels.matmul_nbits_layout import (dequantize_blockwise, dequantize_matmul_nbits, pack_matmul_nbits,
                                                 unpack_matmul_nbits)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows, block", [(128, 32), (576, 128), (100, 64)])
def test_dequantized_error_is_at_most_half_a_step(bits, symmetric, rows, block):
    weight = np.random.default_rng(rows + bits).standard_normal((rows, 24)).astype(np.float32)
    weight[3, 5] = 9.0  # an outlier widens its block's step, not the others'
    quantized = quantize_blockwise(weight, bits, block, symmetric)
    n_blocks = -(-rows // block)
    assert quantized.values.shape == weight.shape and quantized.scales.shape == (n_blocks, 24)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    assert quantized.values.min() >= low and quantized.values.max() <= high
    step = np.repeat(quantized.scales, block, axis=0)[:rows]
    error = np.abs(dequantize_blockwise(quantized) - weight)
    assert np.all(error <= step / 2 + 1e-6)


@pytest.mark.parametrize("rows, block", [(128, 32), (100, 64)])
def test_float_zero_points_fit_each_block_to_its_range_and_split_into_the_kernel_form(rows, block):
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((rows, 24)).astype(np.float32)
    weight[:, :12] += 4.0  # blocks whose range does not hold 0
    quantized = quantize_blockwise(weight, 4, block, symmetric=False, float_zeros=True)
    assert quantized.zero_points.dtype == np.float32 and quantized.values.max() <= 15
    step = np.repeat(quantized.scales, block, axis=0)[:rows]
    error = np.abs(dequantize_blockwise(quantized) - weight)
    assert np.all(error <= step / 2 + 1e-6)
    integer = quantize_blockwise(weight, 4, block, symmetric=False)  # its range must also hold 0
    assert np.all(quantized.scales <= integer.scales + 1e-7) and np.any(quantized.scales < 0.9 * integer.scales)
    split, remainders = split_float_zeros(quantized)
    inside = (quantized.zero_points >= 0) & (quantized.zero_points <= 15)
    assert split.zero_points.dtype == np.uint8 and np.all(np.abs(remainders[inside]) <= 0.5) and not inside.all()
    restored = dequantize_blockwise(split) + np.repeat(quantized.scales * remainders, block, axis=0)[:rows]
    np.testing.assert_allclose(restored, dequantize_blockwise(quantized), atol=1e-6, rtol=0)
    assert split_float_zeros(integer) == (integer, None)


def test_float_zero_points_recover_a_gguf_q4_1_grid_exactly_by_rtn_and_gptq():
    rng = np.random.default_rng(7)
    blocks = rng.standard_normal((4, 32, 16)).astype(np.float32)
    low, scale = blocks.min(axis=1, keepdims=True), np.ptp(blocks, axis=1, keepdims=True) / 15
    weight = (low + scale * rng.integers(0, 16, blocks.shape)).reshape(128, 16).astype(np.float32)
    weight.reshape(4, 32, 16)[:, 0], weight.reshape(4, 32, 16)[:, 1] = low[:, 0], (low + 15 * scale)[:, 0]
    x = rng.standard_normal((256, 128))
    for quantized in (quantize_blockwise(weight, 4, 32, symmetric=False, float_zeros=True),
                      gptq_quantize(weight, x.T @ x, 4, 32, symmetric=False, act_order=True, float_zeros=True)):
        np.testing.assert_allclose(dequantize_blockwise(quantized), weight, atol=1e-6, rtol=0)
    assert np.abs(dequantize_blockwise(quantize_blockwise(weight, 4, 32, symmetric=False)) - weight).max() > 1e-2


def test_zero_blocks_and_bad_arguments():
    quantized = quantize_blockwise(np.zeros((64, 4), np.float32), 4, 32)
    assert np.all(dequantize_blockwise(quantized) == 0)
    with pytest.raises(ValueError):
        quantize_blockwise(np.zeros((64, 4), np.float32), 3, 32)
    with pytest.raises(ValueError):
        quantize_blockwise(np.zeros(64, np.float32), 4, 32)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clipping_lowers_the_output_error_of_heavy_tailed_weights(symmetric):
    from cann_llm.passes.quant.search import CLIP_RATIOS, clip_search, output_error

    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 100)).astype(np.float32) * np.linspace(0.1, 3, 100).astype(np.float32)
    weight = (rng.standard_t(3, (100, 40)) * 0.05).astype(np.float32)  # K = 100: a short last block
    hessian = (x.T @ x).astype(np.float64)
    rtn = output_error(weight, dequantize_blockwise(quantize_blockwise(weight, 4, 32, symmetric)), hessian)
    clipped = clip_search(weight, hessian, 4, 32, symmetric)
    assert output_error(weight, dequantize_blockwise(clipped), hessian) < 0.97 * rtn
    blocks = -(-100 // 32)
    ranges = np.abs(np.concatenate([weight, np.repeat(weight[-1:], blocks * 32 - 100, 0)]).reshape(blocks, 32, 40))
    if symmetric:  # every block's scale is its own range times one of the searched ratios
        ratios = clipped.scales * 7 / ranges.max(axis=1)
        assert np.all(np.min(np.abs(ratios[..., None] - np.asarray(CLIP_RATIOS)), axis=-1) < 1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows, block", [(96, 32), (100, 32), (576, 64)])
def test_matmul_nbits_packing_round_trips_exactly(bits, symmetric, rows, block):
    weight = np.random.default_rng(rows).standard_normal((rows, 12)).astype(np.float32)
    quantized = quantize_blockwise(weight, bits, block, symmetric)
    blob, scales, zero_points = pack_matmul_nbits(quantized)
    n_blocks = -(-rows // block)
    assert blob.dtype == np.uint8 and blob.shape == (12, n_blocks, block * bits // 8)
    back = unpack_matmul_nbits(blob, scales, zero_points, rows, block)
    assert back.bits == bits and np.array_equal(back.values, quantized.values)
    assert np.array_equal(back.scales, quantized.scales)
    assert (back.zero_points is None) == symmetric
    if not symmetric:
        assert np.array_equal(back.zero_points, quantized.zero_points)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmul_int4_and_gather_int4_kernels_match_onnxruntime_on_the_same_bytes(bits, symmetric):
    from onnx import TensorProto, helper, numpy_helper

    from cann_llm.runtime.kernels.quant_matmul import GatherInt4, MatMulInt4
    from cann_llm.runtime.lowering import lower_for_onnxruntime

    rows, cols, block = 96, 40, 32
    rng = np.random.default_rng(bits)
    blob, scales, zero_points = pack_matmul_nbits(quantize_blockwise(
        rng.standard_normal((rows, cols)).astype(np.float32), bits, block, symmetric))
    a, indices = rng.standard_normal((3, rows)).astype(np.float32), np.array([0, 7, 39], np.int64)
    weights = [numpy_helper.from_array(blob, "b"), numpy_helper.from_array(scales, "s")]
    names = ["a", "b", "s"]
    if zero_points is not None:
        weights.append(numpy_helper.from_array(zero_points, "zp"))
        names.append("zp")
    nodes = [helper.make_node("MatMulInt4", names, ["y"], domain="cann", K=rows, N=cols, bits=bits, block_size=block,
                              accuracy_level=0)]
    if symmetric:  # the table lookup is written for symmetric tables only (a tied table is one)
        nodes.append(helper.make_node("GatherInt4", ["b", "i", "s"], ["g"], domain="cann", K=rows, block_size=block,
                                      bits=bits))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, rows]),
                                           helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann", 1)])
    session = ort.InferenceSession(lower_for_onnxruntime(model).SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {"a": a, "i": indices})
    expected = MatMulInt4(a, blob, scales, zero_points, K=rows, N=cols, block_size=block, bits=bits)
    np.testing.assert_allclose(outputs[0], expected, rtol=1e-5, atol=1e-5)
    if symmetric:
        table = dequantize_matmul_nbits(blob, scales, None, rows, block)  # [K, V]: the rows looked up, exactly
        np.testing.assert_allclose(GatherInt4(blob, indices, scales, K=rows, block_size=block, bits=bits),
                                   table[:, indices].T, rtol=0, atol=0)
        np.testing.assert_allclose(outputs[1], table[:, indices].T, rtol=0, atol=1e-6)


def test_int8_activation_rounding_is_onnxruntimes_level_4_rounding_at_near_ties():
    from onnx import TensorProto, helper, numpy_helper

    from cann_llm.runtime.kernels.matmul_nbits_layout import int8_blocks

    # a 4-bit identity weight (scale 1, value 1 on the diagonal): MatMulNBits at level 4 returns its
    # int8-rounded activations themselves
    block = 32
    identity = np.eye(block, dtype=np.float32)
    blob, scales, _ = pack_matmul_nbits(quantize_blockwise(identity, 4, block))
    node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=block, N=block, bits=4,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, block])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(blob, "b"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    rng = np.random.default_rng(3)
    # rows of integers times a scale with an even largest integer (126): 127·q/126 lands on ties, as rows
    # of an 8-bit embedding table do
    levels = rng.integers(-125, 126, (4096, block)).astype(np.float32)
    levels[:, 0] = 126
    a = levels * rng.uniform(0.001, 0.1, (4096, 1)).astype(np.float32)
    largest = np.abs(a).max(axis=-1, keepdims=True)
    by_division = np.rint(a / (largest / np.float32(127)))
    by_product = np.rint(a * (np.float32(127) / largest))
    assert np.any(by_division != by_product)  # the data holds near-ties the two spellings round apart
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    step = largest / np.float32(127)  # compared as int8 levels: the kernel's float products differ by ulps
    assert np.array_equal(np.rint(int8_blocks(a, block) / step), np.rint(got / step))


def test_full_range_quantization_puts_each_blocks_extreme_on_the_lowest_level():
    from cann_llm.passes.quant.math import quantize_full_range

    rng = np.random.default_rng(7)
    weight = rng.standard_normal((96, 40)).astype(np.float32)
    weight[5, 0], weight[40, 1] = 9.0, -9.0  # the extremes of two blocks, one positive, one negative
    quantized = quantize_full_range(weight, 4, 32)
    assert quantized.zero_points is None and quantized.values.min() >= -8 and quantized.values.max() <= 7
    restored = dequantize_blockwise(quantized)
    assert restored[5, 0] == pytest.approx(9.0) and restored[40, 1] == pytest.approx(-9.0)
    assert quantized.values[5, 0] == -8 and quantized.values[40, 1] == -8 and quantized.scales[0, 0] < 0
    # within half a step of every weight the 16 levels span; one step at most beyond the top level (the side
    # of the block opposite its extreme keeps 7 levels), and a lower error than ±7 levels of the same block
    scale = np.repeat(quantized.scales, 32, axis=0)
    inside = weight / scale <= 7.5
    assert np.all(np.abs(restored - weight)[inside] <= np.abs(scale)[inside] / 2 + 1e-6)
    assert np.all(np.abs(restored - weight) <= np.abs(scale) + 1e-6)
    symmetric = dequantize_blockwise(quantize_blockwise(weight, 4, 32, symmetric=True))
    assert np.mean((restored - weight) ** 2) < np.mean((symmetric - weight) ** 2)
    # MatMulNBits' layout stores it as any symmetric weight (q + 8, the default zero point), and onnxruntime's
    # GatherBlockQuantized looks its rows up with the negative scales as they are
    blob, scales, zero_points = pack_matmul_nbits(quantized)
    assert zero_points is None
    np.testing.assert_array_equal(dequantize_matmul_nbits(blob, scales, None, 96, 32), restored)
    from onnx import TensorProto, helper, numpy_helper

    from cann_llm.runtime.lowering import lower_for_onnxruntime

    node = helper.make_node("GatherInt4", ["b", "i", "s"], ["g"], domain="cann", K=96, block_size=32, bits=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("g", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(blob, "b"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann", 1)])
    session = ort.InferenceSession(lower_for_onnxruntime(model).SerializeToString(), providers=["CPUExecutionProvider"])
    looked_up = session.run(None, {"i": np.array([0, 1], np.int64)})[0]
    np.testing.assert_allclose(looked_up, restored[:, :2].T, rtol=0, atol=1e-6)
