"""F28, float32 weights in 28 bits (cann_llm/runtime/kernels/float28.py): packing gives back every weight bit for bit, the
native MatMulF28 (cann_llm/runtime/kernels/native/matmul_panels.c) computes the float64 product within float32 rounding on
both of its paths (one to four rows, and the tiled one from five) and the shapes they split on, with
exceptions of either kind (tiny weights below the exponent window and outliers above it), and the executor
runs the op through onnxruntime's MatMul where the library does not take it."""

from __future__ import annotations


import numpy as np
import onnx
import onnxruntime as ort
import pytest
from native_utils import assert_close_to_product, at_a_page_end, native_session
from onnx import helper, numpy_helper

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import _ort_session, _unpacked_float28
from cann_llm.runtime.kernels import float28, native
from cann_llm.runtime.ops import CUSTOM_DOMAIN

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


@KERNEL
# decode reads a task's panels 4 at a time: 4 (576, 960), 4 then 1 (70, 1100), 4 and a last task's 3
# (100, 1000), 2 (40, 290), 1 (1536, 40)
@pytest.mark.parametrize("k,n", [(576, 960), (64, 48), (33, 47), (1, 16), (1536, 40), (100, 1000), (70, 1100),
                                 (40, 290)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 12, 13, 25, 64])
def test_the_native_op_equals_the_product(k, n, rows):
    w = _weight(k, n, seed=k + n)
    session = native_session(_f28_model(w))
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    assert_close_to_product(session.run(None, {"x": x})[0], x, w)


@KERNEL
def test_the_native_op_takes_any_leading_axes_and_no_rows():
    w = _weight(64, 48)
    session = native_session(_f28_model(w))
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    y = session.run(None, {"x": x})[0]
    assert y.shape == (2, 3, 48)
    assert_close_to_product(y.reshape(6, 48), x.reshape(6, 64), w)
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
        native_session(model).run(None, {"x": np.ones((1, 64), np.float32)})


def test_without_the_native_op_the_weight_is_unpacked_for_onnxruntimes_matmul():
    w = _weight(64, 48)
    model = _f28_model(w)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    plain, unpacked = _unpacked_float28(model, weights, None, "m.om")
    assert [n.op_type for n in plain.graph.node] == ["MatMul"]
    # declared as an external initializer and handed to onnxruntime as it is: no weight goes through a protobuf
    assert [(t.name, t.data_location) for t in plain.graph.initializer] == [("p/float32", onnx.TensorProto.EXTERNAL)]
    assert np.array_equal(unpacked["p/float32"].view(np.uint32), w.view(np.uint32))
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in unpacked.items()}
    session = _ort_session(plain, None, 2, True, unpacked=values)
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    assert_close_to_product(session.run(None, {"x": x})[0], x, w)
    assert _unpacked_float28(model, weights, lambda node: True, "m.om") == (model, {})


@pytest.mark.parametrize("broken,message", [
    (lambda ops: {**ops, "o": np.array([0, 9, 1, ops["q"].size], np.int32)}, "offsets do not rise"),
    (lambda ops: {**ops, "q": np.concatenate([ops["q"][:-1], [64 * 16]]).astype(np.int32)}, "exception position"),
    (lambda ops: {**ops, "p": ops["p"][:2]}, "packed weight holds"),
    (lambda ops: {k: v for k, v in ops.items() if k != "v"}, "values is not a constant")])
def test_unpacking_refuses_operands_that_break_the_layout(broken, message):
    model = _f28_model(_weight(64, 48, outliers=2))
    weights = broken({t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    del model.graph.initializer[:]
    with pytest.raises(AtcError, match=f"E13015.*m.om.*{message}"):
        _unpacked_float28(model, weights, None, "m.om")


def _inputs_model(k: int, n: int, bias: int) -> onnx.ModelProto:
    """MatMulF28 with every operand a graph input: what no compiled artifact has, but a hostile one can."""
    node = helper.make_node("MatMulF28", ["x", "p", "o", "q", "v"], ["y"], domain=CUSTOM_DOMAIN, K=k, N=n, bias=bias)
    types = {"x": onnx.TensorProto.FLOAT, "p": onnx.TensorProto.UINT8, "o": onnx.TensorProto.INT32,
             "q": onnx.TensorProto.INT32, "v": onnx.TensorProto.FLOAT}
    graph = helper.make_graph([node], "f28", [helper.make_tensor_value_info(name, t, None) for name, t in types.items()],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])


@KERNEL
def test_the_native_op_checks_its_operands_on_every_run():
    """Operands fed anew each run (the same buffers with other contents, or none at all: a weight without
    exceptions) are checked each run, never trusted from an earlier one."""
    w = (np.random.default_rng(4).standard_normal((64, 48)) * 0.02).astype(np.float32)
    packed = float28.pack(w, max_exceptions=1.0)
    session = native_session(_inputs_model(64, 48, packed.bias))
    feeds = {"x": np.ones((1, 64), np.float32), "p": packed.packed, "o": packed.offsets, "q": packed.positions,
             "v": packed.values}
    assert_close_to_product(session.run(None, feeds)[0], feeds["x"], w)
    positions = feeds["q"]
    if positions.size:
        positions[0] = 64 * 16  # the same buffer, out of bounds now
        with pytest.raises(Exception, match="MatMulF28: an exception position is outside"):
            session.run(None, feeds)
    empty = {**feeds, "q": np.zeros(0, np.int32), "v": np.zeros(0, np.float32)}
    for offsets in ([0, 100, 0, 0], [0, -5, 0, 0]):  # no exceptions, offsets that would index them anyway
        for rows in (1, 8):
            with pytest.raises(Exception, match="MatMulF28: the exception offsets"):
                session.run(None, {**empty, "x": np.ones((rows, 64), np.float32), "o": np.array(offsets, np.int32)})



@KERNEL
# from 17 panels a task reads several side by side, and the tensor ends in a chunk of 2 (3, 280), 3 (5, 1000)
# or 4 (3, 1100) panels
@pytest.mark.parametrize("k,n", [(1, 16), (1, 17), (2, 1), (3, 48), (4, 33), (64, 80), (5, 5), (3, 280), (5, 1000),
                                 (1, 1000), (3, 1100)])
def test_the_native_op_reads_nothing_past_its_operands(k, n):
    """Each operand ends at an inaccessible page (the packed weight is the last thing in its mapping, as an
    artifact's last tensor is): the 64-byte loads of 56-byte groups stop at the tensor's last one."""
    rng = np.random.default_rng(k * 100 + n)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    w.reshape(-1)[::5] = 1e-30  # exceptions in most panels
    packed = float28.pack(w, max_exceptions=1.0)
    session = native_session(_inputs_model(k, n, packed.bias))
    keep: list = []
    feeds = {name: at_a_page_end(array, keep) for name, array in
             (("p", packed.packed), ("o", packed.offsets), ("q", packed.positions), ("v", packed.values))}
    for rows in (1, 3, 4, 5, 13):
        x = at_a_page_end(rng.standard_normal((rows, k)).astype(np.float32), keep)
        assert_close_to_product(session.run(None, {"x": x, **feeds})[0], x, w)


@KERNEL
def test_a_zero_code_is_zero_whatever_its_other_bits():
    """A code whose exponent part is 0 is +0.0 in both readers, even with sign or mantissa bits set (no
    compiler writes one: only a damaged artifact)."""
    w = np.full((4, 16), 0.5, np.float32)
    packed = float28.pack(w)
    damaged = packed.packed.copy()
    damaged[0, 0, :4] = np.frombuffer(np.uint32(0x0800_0001 | 1 << 27).tobytes(), np.uint8)  # code 0 of lane 0, sign set
    ops = (damaged, packed.offsets, packed.positions, packed.values)
    reference = float28.unpack(*ops, K=4, N=16, bias=packed.bias)
    assert reference[0, 0] == 0.0
    session = native_session(_inputs_model(4, 16, packed.bias))
    x = np.eye(4, dtype=np.float32)
    got = session.run(None, {"x": x, "p": damaged, "o": packed.offsets, "q": packed.positions, "v": packed.values})[0]
    np.testing.assert_array_equal(got.view(np.uint32), reference.view(np.uint32))
