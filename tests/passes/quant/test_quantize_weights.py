"""WeightQuantizationPass alone: what it writes, its numbers, and each refusal."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs
import pytest
from fusion_utils import apply_pass, assert_parity, op_counts, run_fused, run_original
from onnx import TensorProto, helper, numpy_helper

from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.math import quantize_blockwise
from cann_llm.passes.quant.qdq_weight import read_qdq_weight
from cann_llm.passes.quant.quantize_weights import QuantizeWeights
from cann_llm.runtime.kernels.matmul_nbits_layout import dequantize_blockwise

pytestmark = pytest.mark.unit

K, N = 96, 40
RNG = np.random.default_rng(5)
WEIGHT = (0.1 * RNG.standard_normal((K, N))).astype(np.float32)
FEEDS = {"x": RNG.standard_normal((2, 3, K)).astype(np.float32)}


def _model(weight_inputs, weight_initializers, nodes=(), opset=21):
    nodes = list(nodes) + [helper.make_node("MatMul", ["x", weight_inputs], ["y"], name="proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])], weight_initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True)])
def test_a_float_weight_becomes_a_quantized_matmul_that_computes_its_dequantization(bits, symmetric, tmp_path):
    config = QuantConfig(bits=bits, group_size=32, symmetric=symmetric, skip_layers=(), accuracy_level="0")
    model = _model("w", [numpy_helper.from_array(WEIGHT, "w")])
    fused, (result,) = apply_pass(model, QuantizeWeights(config))
    op = "MatMulInt4" if bits == 4 else "MatMulInt8"
    assert (result.match_times, result.effect_times) == (1, 1) and op_counts(fused)[op] == 1
    assert "MatMul" not in op_counts(fused)
    block = 32 if bits == 4 else K
    dequantized = dequantize_blockwise(quantize_blockwise(WEIGHT, bits, block, symmetric))
    assert_parity(_model("w", [numpy_helper.from_array(dequantized, "w")]), fused, FEEDS, tmp_path)


def _gguf_q4_1(weight, block=32):
    """`weight` moved onto GGUF Q4_1's grid: per block of K, min + scale·q with q in 0..15."""
    blocks = weight.reshape(-1, block, weight.shape[1])
    low, scale = blocks.min(axis=1, keepdims=True), np.ptp(blocks, axis=1, keepdims=True) / 15
    return (low + scale * np.rint((blocks - low) / scale)).reshape(weight.shape).astype(np.float32)


def test_float_zero_points_reproduce_a_q4_1_weight_exactly_where_integer_ones_cannot(tmp_path):
    model = _model("w", [numpy_helper.from_array(_gguf_q4_1(WEIGHT), "w")])
    fused = {}
    for zero_points in ("integer", "float"):
        config = QuantConfig(group_size=32, symmetric=False, zero_points=zero_points, skip_layers=(), accuracy_level="0")
        fused[zero_points], (result,) = apply_pass(model, QuantizeWeights(config))
        assert result.effect_times == 1
    # MatMulInt4 on integer zero points, plus x's block sums times the offsets (built from int8 remainders)
    assert op_counts(fused["float"]) == {"MatMulInt4": 1, "MatMul": 2, "Add": 1, "Cast": 1, "Mul": 2, "Transpose": 1}
    expected = run_original(model, FEEDS)[0]
    error = {name: np.abs(run_fused(graph, FEEDS, "onnxruntime", tmp_path)[0] - expected).max()
             for name, graph in fused.items()}
    # int8 remainders leave ~1e-5 of outputs of magnitude ~1; integer zero points move whole groups
    assert error["float"] < 1e-3 and error["integer"] > 100 * error["float"], error
    assert_parity(model, fused["float"], FEEDS, tmp_path, atol=1e-3)


def _qdq(values, scale, axis=0, block=32, constant_scale=True):
    inputs = ["q", "s"]
    initializers = [numpy_helper.from_array(values, "q")]
    if constant_scale:
        initializers.append(numpy_helper.from_array(scale, "s"))
    attrs = {"axis": axis, "block_size": block} if block else {"axis": axis}
    model = _model("w", initializers, [helper.make_node("DequantizeLinear", inputs, ["w"], **attrs)])
    if not constant_scale:
        model.graph.input.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, list(scale.shape)))
    return model


@pytest.mark.parametrize("model, config, reason", [
    (lambda: _model("w", [numpy_helper.from_array(WEIGHT, "w")]), None, "compression is off"),
    (lambda: _model("w_in", []), QuantConfig(skip_layers=()), "not a constant 2-D float32"),
    (lambda: _model("w", [numpy_helper.from_array(WEIGHT, "w")]), QuantConfig(skip_layers=("pro*",)), "skipped by"),
    (lambda: _qdq(np.zeros((K, N), ml_dtypes.int4), np.ones((K // 32, N), np.float32), constant_scale=False),
     None, "not constants"),
    (lambda: _qdq(np.zeros((K, N), np.int8), np.ones((), np.float32), axis=1, block=0), None, "unsupported"),
])
def test_refusals(model, config, reason):
    built = model()
    if reason == "not a constant 2-D float32":
        built.graph.input.append(helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [K, N]))
    fused, (result,) = apply_pass(built, QuantizeWeights(config))
    assert result.effect_times == 0 and "MatMulInt4" not in op_counts(fused)
    assert any(reason in r for r in result.rejections), result.rejections


def test_every_skip_pattern_naming_a_matmul_counts_as_matched_not_only_the_first():
    # "pro*" names the MatMul node, "w" its weight: neither may be refused as matching nothing
    quantizer = QuantizeWeights(QuantConfig(skip_layers=("pro*", "w")))
    fused, (result,) = apply_pass(_model("w", [numpy_helper.from_array(WEIGHT, "w")]), quantizer)
    assert quantizer.matched_patterns >= {"pro*", "w"} and result.effect_times == 0


def test_match_only_chooses_and_rewrite_quantizes_reporting_each_weight(capsys):
    graph = gs.import_onnx(_model("w", [numpy_helper.from_array(WEIGHT, "w")]))
    quantizer = QuantizeWeights(QuantConfig(group_size=32, skip_layers=(), accuracy_level="0"), progress=True)
    (matmul,) = [n for n in graph.nodes if n.op == "MatMul"]
    choice = quantizer.match(graph, matmul)
    assert choice.matmul is matmul and choice.qdq is None and [n.op for n in graph.nodes] == ["MatMul"]
    quantizer.rewrite(graph, choice)
    assert "MatMulInt4" in [n.op for n in graph.nodes] and not matmul.inputs
    assert capsys.readouterr().err == ""  # progress belongs to a run, not to one rewrite
    result = quantizer.run(gs.import_onnx(_model("w", [numpy_helper.from_array(WEIGHT, "w")])))
    lines = capsys.readouterr().err.splitlines()
    assert result.effect_times == 1 and lines[0] == "quantization: started, 1 weights"
    assert lines[-1].startswith("quantization: 1 weights in ")


@pytest.mark.parametrize("storage,zero_point", [(np.int8, None), (np.uint8, 131)])
def test_a_per_column_qdq_weight_is_read_as_it_lies(storage, zero_point):
    """Its integers are the constant's own bytes, not a copy: WeightQuantizationPass matches every weight
    before it packs one, so a copy each would hold the model's 8-bit weights twice."""
    info = np.iinfo(storage)
    values = np.random.default_rng(0).integers(info.min, info.max + 1, (16, 8)).astype(storage)
    parts = [gs.Constant("w", values), gs.Constant("s", np.full(8, 0.02, np.float32))]
    if zero_point is not None:
        parts.append(gs.Constant("z", np.full(8, zero_point, storage)))
    weight = gs.Variable("dq", dtype=np.float32, shape=[16, 8])
    gs.Node("DequantizeLinear", inputs=parts, outputs=[weight], attrs={"axis": 1})
    read = read_qdq_weight(weight)
    assert np.shares_memory(read.quantized.values, values) and read.quantized.values.dtype == storage


@pytest.mark.parametrize("mode", ["W8A8", "INT4"])
def test_matmuls_that_share_an_input_each_read_its_calibration(mode, tmp_path):
    """Gemma's GELU MLP keeps gate and up as two MatMuls of one input: the second read statistics the first
    had released (W8A8 failed with E19999; INT4's accuracy level, chosen from them, differed within a pair)."""
    import json

    from conftest import compile_to

    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime import load_artifact

    conf = tmp_path / "quant.json"
    conf.write_text(json.dumps({"quant_mode": mode}))
    om = compile_to(tiny_onnx("gemma", dynamo=True, with_past=True), tmp_path / "m", enable_paged_attention=True,
                    enable_compress_weight=True, compress_weight_conf=str(conf))
    graph = load_artifact(om).model.graph
    scaled = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "Mul"}  # SmoothQuant's
    levels: dict[str, list[int]] = {}  # of the MatMuls reading each input, before any scaling of their own
    for node in graph.node:
        if node.op_type == "MatMulInt4":
            source = scaled.get(node.input[0], node.input[0])
            levels.setdefault(source, []).append(next(a.i for a in node.attribute if a.name == "accuracy_level"))
    pairs = [found for found in levels.values() if len(found) == 2]
    assert len(pairs) == 2 and all(len(set(found)) == 1 for found in levels.values()), levels  # a pair a layer


def _two_readers(weight):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y0"], name="first"),
             helper.make_node("MatMul", ["x", "w"], ["y1"], name="second"), helper.make_node("Add", ["y0", "y1"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])],
                              [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_weight_two_matmuls_read_is_packed_once(tmp_path):
    """Gemma 3n's AltUp router reads one weight twice: one packed copy, under one name."""
    config = QuantConfig(bits=4, group_size=32, symmetric=True, skip_layers=(), accuracy_level="0")
    fused, (result,) = apply_pass(_two_readers(WEIGHT), QuantizeWeights(config))
    first, second = [n for n in fused.graph.node if n.op_type == "MatMulInt4"]
    assert result.effect_times == 2 and list(first.input[1:]) == list(second.input[1:])
    names = [t.name for t in fused.graph.initializer]
    assert len(names) == len(set(names))
    dequantized = dequantize_blockwise(quantize_blockwise(WEIGHT, 4, 32, True))
    assert_parity(_two_readers(dequantized), fused, FEEDS, tmp_path)


def test_a_weight_packed_two_ways_keeps_each_under_its_own_name():
    """AWQ scales a shared weight by each reader's activations: the two packings must not share a name."""
    from cann_llm.passes.quant.quantized_matmul import QuantizedMatMulWriter

    graph = gs.import_onnx(_two_readers(WEIGHT))
    writer = QuantizedMatMulWriter()
    matmuls = [n for n in graph.nodes if n.op == "MatMul"]
    for matmul, scale in zip(matmuls, (1.0, 2.0)):
        writer.matmul_nbits(graph, matmul, "w", quantize_blockwise(WEIGHT * scale, 4, 32, True), None, 0)
    first, second = [n for n in graph.nodes if n.op == "MatMulInt4"]
    assert [t.name for t in first.inputs[1:]] == ["w_int4", "w_scales"]
    assert [t.name for t in second.inputs[1:]] == ["w/second_int4", "w/second_scales"]
    np.testing.assert_allclose(second.inputs[2].values, 2 * first.inputs[2].values, rtol=1e-6)
