"""F28, float32 weights in 28 bits (runtime/kernels/float28.py): packing gives back every weight bit for bit, the
native MatMulF28 (runtime/kernels/native/matmul_f28.c) computes the float64 product within float32 rounding on
both of its paths (one to four rows, and the tiled one from five) and the shapes they split on, with
exceptions of either kind (tiny weights below the exponent window and outliers above it), and the executor
runs the op through onnxruntime's MatMul where the library does not take it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from runtime.executor import _unpacked_float28
from runtime.kernels import float28, native
from runtime.ops import CUSTOM_DOMAIN
from runtime.ort_session import session_options

KERNEL = pytest.mark.skipif(not native.has_float28_matmul(), reason="this CPU has no AVX-512 VBMI: no native MatMulF28")


def _weight(k: int, n: int, seed: int = 0, outliers: int = 3) -> np.ndarray:
    """A trained layer's scale, with zeros, tiny weights, a denormal, -0.0 and a few large outliers."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    flat = w.reshape(-1)
    flat[::89] = 0.0
    flat[5::397] = 3e-9
    flat[7::1009] = -0.0
    flat[min(11, flat.size - 1)] = 1.4e-45
    flat[rng.choice(flat.size, min(outliers, flat.size), replace=False)] = rng.choice([-1e4, 2e4], min(outliers, flat.size))
    return w


@pytest.mark.parametrize("k,n", [(576, 960), (64, 48), (33, 47), (1, 16), (7, 5), (1536, 40)])
def test_packing_gives_back_every_weight_bit_for_bit(k, n):
    w = _weight(k, n, outliers=1)
    packed = float28.pack(w, max_exceptions=1.0)
    assert packed.packed.shape == (-(-n // 16), k, 56)
    unpacked = float28.unpack(packed.packed, packed.offsets, packed.positions, packed.values, K=k, N=n, bias=packed.bias)
    assert unpacked.dtype == np.float32 and unpacked.shape == (k, n)
    assert np.array_equal(unpacked.view(np.uint32), w.view(np.uint32))
    # outside the window: the tiny ones, the denormal, -0.0 and the outlier; zeros are coded, never listed
    expected = np.count_nonzero(w.view(np.uint32)) - np.count_nonzero(
        (np.abs(w) >= 2.0 ** (packed.bias - 126)) & (np.abs(w) < 2.0 ** (packed.bias - 111)))
    assert packed.values.size == expected


def test_a_trained_scale_takes_seven_eighths_of_the_bytes():
    w = (np.random.default_rng(1).standard_normal((576, 3072)) * 0.02).astype(np.float32)
    packed = float28.pack(w)
    assert packed.packed.nbytes == w.nbytes * 7 // 8
    assert packed.values.size < w.size // 1000  # only weights below 2^-14 of the largest exponent


@pytest.mark.parametrize("values", [[[np.inf, 1.0]], [[np.nan, 1.0]], np.logspace(-30, 30, 64, dtype=np.float32).reshape(8, 8)])
def test_weights_that_would_not_pay_stay_float32(values):
    assert float28.pack(np.asarray(values, np.float32)) is None


def _f28_model(w: np.ndarray) -> onnx.ModelProto:
    packed = float28.pack(w, max_exceptions=1.0)
    inits = [numpy_helper.from_array(array, name) for name, array in
             (("p", packed.packed), ("o", packed.offsets), ("q", packed.positions), ("v", packed.values))]
    node = helper.make_node("MatMulF28", ["x", "p", "o", "q", "v"], ["y"], domain=CUSTOM_DOMAIN, K=w.shape[0],
                            N=w.shape[1], bias=packed.bias)
    graph = helper.make_graph([node], "f28", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])


def _native_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = session_options(2)
    options.register_custom_ops_library(str(native.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _close(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # float32 sums of K products, relative to the sum of their magnitudes (a missed outlier would be ~1)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + 1e-30
    assert np.max(np.abs(y - exact) / scale) < 1e-5


@KERNEL
@pytest.mark.parametrize("k,n", [(576, 960), (64, 48), (33, 47), (1, 16), (1536, 40), (100, 1000)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 12, 13, 25, 64])
def test_the_native_op_equals_the_product(k, n, rows):
    w = _weight(k, n, seed=k + n)
    session = _native_session(_f28_model(w))
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    _close(session.run(None, {"x": x})[0], x, w)


@KERNEL
def test_the_native_op_takes_any_leading_axes_and_no_rows():
    w = _weight(64, 48)
    session = _native_session(_f28_model(w))
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    y = session.run(None, {"x": x})[0]
    assert y.shape == (2, 3, 48)
    _close(y.reshape(6, 48), x.reshape(6, 64), w)
    assert session.run(None, {"x": np.zeros((0, 64), np.float32)})[0].shape == (0, 48)


def _out_of_bounds(q):
    q = q.copy()
    q[0] = 64 * 16
    return q


@KERNEL
@pytest.mark.parametrize("field,change,message", [
    ("q", _out_of_bounds, "exception position is outside"),
    ("q", lambda q: q[1:], "do not span"),
    ("p", lambda p: p[1:], "packed weight is not"),
    ("o", lambda o: np.concatenate([[0, o[-1]], o[2:-1], [o[-1]]]).astype(np.int32), "offsets decrease")])
def test_the_native_op_refuses_operands_that_break_the_layout(field, change, message):
    model = _f28_model(_weight(64, 48, outliers=2))
    for tensor in model.graph.initializer:
        if tensor.name == field:
            tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor)), field))
    with pytest.raises(Exception, match=f"MatMulF28: .*{message}"):
        _native_session(model).run(None, {"x": np.ones((1, 64), np.float32)})


def test_without_the_native_op_the_weight_is_unpacked_for_onnxruntimes_matmul():
    w = _weight(64, 48)
    model = _f28_model(w)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    plain = _unpacked_float28(model, weights, keep=None)
    assert [n.op_type for n in plain.graph.node] == ["MatMul"]
    assert [t.name for t in plain.graph.initializer] == ["p/float32"]
    assert np.array_equal(numpy_helper.to_array(plain.graph.initializer[0]).view(np.uint32), w.view(np.uint32))
    session = ort.InferenceSession(plain.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    _close(session.run(None, {"x": x})[0], x, w)
    assert _unpacked_float28(model, weights, keep=lambda node: True) is model
