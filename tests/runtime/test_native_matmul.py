"""The native MatMulInt4 (cann_llm/runtime/kernels/native/matmul_int4.c) inside onnxruntime: the same products as the
numpy reference and as onnxruntime's own MatMulNBits on the same bytes, over the shapes its paths split on
(whole groups of 16 columns and the columns after them, a partial last block, one row, a few and enough
for the lane path), with an input scale, and the executor's choice of which nodes it takes and which
constant Muls move into them. Both kernels where the machine runs them: the library built here, and on a
CPU with AVX-512 a second one built with `-mno-avx512f`, which takes the AVX2 kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from cann_llm.runtime.compatibility import cpu_features
from cann_llm.runtime.executor import _native_nodes
from cann_llm.runtime.kernels import native
from cann_llm.runtime.kernels.quant_matmul import MatMulInt4
from cann_llm.runtime.lowering import lower_for_onnxruntime, with_input_scales
from cann_llm.runtime.ops import CUSTOM_DOMAIN, attributes

KERNEL = pytest.mark.skipif(not native.has_int8_matmul(), reason="this CPU has neither AVX-512 VNNI nor AVX2")

BLOCK = 128


# the AVX2 kernel is a second library only where the one built here takes AVX-512's
KERNELS = ["native"] + (["avx2"] if native.matmul_isa() == 512
                        and {"avx2", "fma"} <= cpu_features() else [])


@pytest.fixture(params=KERNELS)
def library(request) -> Path:
    """Each kernel this machine runs: the library built here, then the AVX2 one where that is another."""
    if request.param == "avx2":
        return request.getfixturevalue("avx2_library")
    if not native.has_int8_matmul():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    return native.library_path()


def _operands(k: int, n: int, bits: int, zero_points: bool, seed: int = 0, block: int = BLOCK):
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    b = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    zp = None
    if zero_points:
        zp = rng.integers(0, 256, n * (-(-blocks // 2)) if bits == 4 else n * blocks, dtype=np.uint8)
    return b, scales, zp


def _session(op: str, domain: str, k: int, n: int, bits: int, b, scales, zp, accuracy_level: int = 4,
             block: int = BLOCK, library: Path | None = None):
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
    inputs = ["A", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        inputs.append("Z")
    node = helper.make_node(op, inputs, ["Y"], domain=domain, K=k, N=n, bits=bits, block_size=block,
                            accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "one_matmul", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if domain == CUSTOM_DOMAIN:
        options.register_custom_ops_library(str(library or native.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits, block", [(4, 128), (4, 64), (4, 32), (8, 128), (8, 64)])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("k, n, rows", [
    (576, 48, (1,)),          # three whole groups of 16 columns, a last block of 64 (4 bits, blocks of 64: half a piece)
    (256, 40, (1, 3)),        # two groups and 8 columns after them
    (1000, 5, (2,)),          # only columns after the groups; K not a multiple of 16
    (384, 64, (9, 1, 6)),     # rows enough to quantize on threads, 4 at a time and one by one, [rows, tokens, K]
    (576, 40, (12,)),         # four at a time, three tiles of 4 rows
    (576, 40, (29,)),         # the lane path: two tiles of 12 rows and one of 5, a padded last group
    (256, 16, (16,)),         # the lane path: one tile of 12 and one of 4, one whole group
])
def test_the_native_matmul_equals_the_reference_and_onnxruntimes_kernel(library, bits, block, zero_points, k, n, rows):
    b, scales, zp = _operands(k, n, bits, zero_points, block=block)
    ours = _session("MatMulInt4", CUSTOM_DOMAIN, k, n, bits, b, scales, zp, block=block, library=library)
    theirs = _session("MatMulNBits", "com.microsoft", k, n, bits, b, scales, zp, block=block)
    a = np.random.default_rng(1).standard_normal((*rows, k)).astype(np.float32)
    got = ours.run(None, {"A": a})[0]
    expected = MatMulInt4(a, b, scales, zp, K=k, N=n, block_size=block, bits=bits, accuracy_level=4)
    mlas = theirs.run(None, {"A": a})[0]
    assert got.shape == (*rows, n)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(got, mlas, rtol=0, atol=2e-5 * scale)


def test_a_block_of_zeros_and_a_row_of_zeros_give_exact_products(library):
    k, n, bits = 384, 32, 4
    b, scales, zp = _operands(k, n, bits, True, seed=3)
    a = np.random.default_rng(2).standard_normal((3, k)).astype(np.float32)
    a[0] = 0.0
    a[1, BLOCK:2 * BLOCK] = 0.0
    got = _session("MatMulInt4", CUSTOM_DOMAIN, k, n, bits, b, scales, zp, library=library).run(None, {"A": a})[0]
    expected = MatMulInt4(a, b, scales, zp, K=k, N=n, block_size=BLOCK, bits=bits, accuracy_level=4)
    assert np.all(got[0] == 0.0)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))


def test_activations_whose_last_axis_is_not_k_are_refused(library):
    b, scales, zp = _operands(256, 16, 4, True)
    session = _session("MatMulInt4", CUSTOM_DOMAIN, 256, 16, 4, b, scales, zp, library=library)
    with pytest.raises(Exception, match="MatMulInt4: A's last axis is not K"):
        session.run(None, {"A": np.zeros((1, 200), np.float32)})


def _graph_of(nodes: list[onnx.NodeProto], zero_point_type: int) -> onnx.ModelProto:
    inits = [helper.make_tensor("B", onnx.TensorProto.UINT8, [16, 2, 64], bytes(16 * 2 * 64), raw=True),
             helper.make_tensor("S", onnx.TensorProto.FLOAT, [32], [0.1] * 32),
             helper.make_tensor("Z", zero_point_type, [16], [8] * 16)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes],
                              inits)
    return helper.make_model(graph)


def _matmul(name: str, **attrs) -> onnx.NodeProto:
    settings = {"K": 256, "N": 16, "bits": 4, "block_size": BLOCK, "accuracy_level": 4, **attrs}
    return helper.make_node("MatMulInt4", ["A", "B", "S", "Z"], [name], domain=CUSTOM_DOMAIN, **settings)


@KERNEL
def test_the_executor_gives_the_library_only_the_matmuls_it_computes_as_matmulnbits():
    nodes = [_matmul("level4"), _matmul("level0", accuracy_level=0), _matmul("blocks32", block_size=32),
             _matmul("blocks64", block_size=64), _matmul("eight_bits", bits=8),
             _matmul("eight_bits_blocks64", bits=8, block_size=64), _matmul("eight_bits_blocks32", bits=8, block_size=32)]
    keep = _native_nodes(_graph_of(nodes, onnx.TensorProto.UINT8))
    assert [node.output[0] for node in nodes if keep(node)] == ["level4", "blocks32", "blocks64", "eight_bits",
                                                                 "eight_bits_blocks64"]
    assert not _native_nodes(_graph_of(nodes, onnx.TensorProto.UINT8), matmul=False)(nodes[0])
    floats = _native_nodes(_graph_of([_matmul("float_zero_points")], onnx.TensorProto.FLOAT))
    assert not floats(_matmul("float_zero_points"))


@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("block", [BLOCK, 64, 32])
def test_an_input_scale_multiplies_the_activations_before_they_are_quantized(library, zero_points, block):
    k, n, bits = 576, 40, 4
    b, scales, zp = _operands(k, n, bits, zero_points, seed=4, block=block)
    scale = np.random.default_rng(5).uniform(0.2, 3.0, k).astype(np.float32)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"), numpy_helper.from_array(scale, "s")]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
    node = helper.make_node("MatMulInt4", ["A", "B", "S", "Z" if zp is not None else "", "s"], ["Y"],
                            domain=CUSTOM_DOMAIN, K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    a = np.random.default_rng(6).standard_normal((5, k)).astype(np.float32)
    expected = MatMulInt4(a * scale, b, scales, zp, K=k, N=n, block_size=block, bits=bits, accuracy_level=4)
    tolerance = 2e-5 * float(np.abs(expected).max())
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    native_run = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(native_run.run(None, {"A": a})[0], expected, rtol=0, atol=tolerance)
    # where the library does not take the node, lowering puts the Mul back before onnxruntime's MatMulNBits
    lowered = lower_for_onnxruntime(model)
    assert [node.op_type for node in lowered.graph.node] == ["Mul", "MatMulNBits"]
    plain = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(plain.run(None, {"A": a})[0], expected, rtol=0, atol=tolerance)


def test_a_constant_mul_read_only_by_a_native_matmul_moves_into_it():
    inits = [helper.make_tensor(name, onnx.TensorProto.FLOAT, [256], [0.5] * 256) for name in ("s", "t")]
    inits.append(helper.make_tensor("scalar", onnx.TensorProto.FLOAT, [1], [2.0]))
    nodes = [helper.make_node("Mul", ["A", "s"], ["moved"]),           # read by one kept matmul: moves
             helper.make_node("Mul", ["A", "t"], ["shared"]),          # read by two: stays
             helper.make_node("Mul", ["A", "scalar"], ["by_scalar"]),  # not a [K] vector: stays
             helper.make_node("Mul", ["A", "s"], ["lowered"]),         # read by a matmul the library does not take
             _matmul("y1"), _matmul("y2"), _matmul("y3"), _matmul("y4"), _matmul("y5", accuracy_level=0)]
    for node, source in zip(nodes[4:], ["moved", "shared", "shared", "by_scalar", "lowered"]):
        node.input[0] = source
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, None) for i in range(1, 6)],
                              inits)
    model = helper.make_model(graph)
    moved = with_input_scales(model, lambda node: attributes(node)["accuracy_level"] == 4)
    by_output = {node.output[0]: node for node in moved.graph.node}
    assert "moved" not in by_output and {"shared", "by_scalar", "lowered"} <= set(by_output)
    assert list(by_output["y1"].input) == ["A", "B", "S", "Z", "s"]
    assert [len(by_output[y].input) for y in ("y2", "y3", "y4", "y5")] == [4, 4, 4, 4]
    assert len(model.graph.node) == 9  # the model itself is left alone


def test_a_library_built_without_avx2_has_no_matmul_and_every_matmul_is_left_to_onnxruntime(tmp_path):
    import os
    import subprocess
    import sys

    compiler = os.environ.get("CC") or "cc"
    wrapper = tmp_path / "cc"  # the machine's compiler, told the CPU has no AVX2 (and so no AVX-512)
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@" -mno-avx2\n')
    wrapper.chmod(0o755)
    script = ("import onnx\n"
              "from cann_llm.runtime.kernels import native\n"
              "from tests.runtime.test_native_matmul import _graph_of, _matmul\n"
              "from cann_llm.runtime.executor import _native_nodes\n"
              "keep = _native_nodes(_graph_of([_matmul('level4')], onnx.TensorProto.UINT8))\n"
              "print(native.library_path().exists(), native.has_int8_matmul(), keep(_matmul('level4')))\n")
    env = {**os.environ, "CC": str(wrapper), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "False"]
