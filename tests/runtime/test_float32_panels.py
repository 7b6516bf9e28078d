"""Float32 MatMul weights laid out in panels at load (cann_llm/runtime/kernels/float32_panels.py) for the native MatMulF32
(cann_llm/runtime/kernels/native/matmul_panels.c): the layout gives back every weight bit for bit, the native op
computes the float64 product within float32 rounding on every row count and shape and reads nothing past its
operands, and the runtime turns every float32 MatMul of an artifact (a tied head's through its Transpose)
into one, generating transformers' greedy tokens, where onnxruntime's MatMul runs when the native matmuls
are off or the weights are shared."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import compile_to
from generation_utils import hf_greedy, mixed_prompts
from native_utils import assert_close_to_product, at_a_page_end, native_session
from onnx import helper, numpy_helper

from cann_llm import LLMEngine
from cann_llm.runtime.executor import Executor, _float32_panels
from cann_llm.runtime.kernels import float32_panels, native
from cann_llm.runtime.loader import load_artifact
from cann_llm.runtime.ops import CUSTOM_DOMAIN

KERNEL = pytest.mark.skipif(not native.has_float32_panel_matmul(), reason="this CPU has no AVX-512: no native MatMulF32")


@pytest.fixture(scope="module", params=["this CPU's prefetch", "the other prefetch"])
def f32_library(request):
    """The library as built here, then one whose MatMulF32 decode takes the other prefetch form (software
    prefetch ahead of each stream, or the hardware's alone: the library picks by CPU: not on AMD's Zen 4), so both are tested
    on any machine."""
    if not native.has_float32_panel_matmul():
        pytest.skip("this CPU has no AVX-512: no native MatMulF32")
    here = native.library_path()
    if request.param == "this CPU's prefetch":
        return here
    other = native.library_path((f"-DGEMV_SOFTWARE_PREFETCH={0 if native.float32_software_prefetch(here) else 1}",))
    assert native.float32_software_prefetch(other) != native.float32_software_prefetch(here)
    return other


def _weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.02).astype(np.float32)


@pytest.mark.parametrize("k,n", [(576, 960), (64, 48), (33, 47), (1, 16), (7, 5), (1536, 40)])
def test_the_layout_gives_back_every_weight_bit_for_bit(k, n):
    w = _weight(k, n, seed=k + n)
    panels = float32_panels.pack(w)
    assert panels.shape == (-(-n // 16), k, 16)
    column = np.arange(n)
    np.testing.assert_array_equal(panels[column // 16, :, column % 16], w.T)  # panels[p, k, j] is w[k, 16p + j]
    assert not panels[-1, :, n - 16 * (panels.shape[0] - 1):].any()  # the last panel's padding is zeros
    np.testing.assert_array_equal(float32_panels.unpack(panels, K=k, N=n).view(np.uint32), w.view(np.uint32))
    # a transposed view (a tied head's table) is laid out as the matrix it stands for
    table = np.ascontiguousarray(w.T)
    np.testing.assert_array_equal(float32_panels.pack(table.T), panels)
    # and a matrix of other strides as its contiguous copy
    wide = np.repeat(np.repeat(w, 2, axis=0), 2, axis=1)
    np.testing.assert_array_equal(float32_panels.pack(wide[::2, ::2]), panels)


@pytest.mark.parametrize("weight", [np.zeros((4, 4), np.float64), np.zeros((2, 3, 4), np.float32), np.zeros((0, 4), np.float32)])
def test_what_is_not_a_float32_matrix_is_not_laid_out(weight):
    assert float32_panels.pack(weight) is None


def test_unpacking_refuses_panels_of_another_shape():
    with pytest.raises(ValueError, match="the panels hold 64 floats, K 4 and N 17 make 128"):
        float32_panels.unpack(np.zeros((1, 4, 16), np.float32), K=4, N=17)


def _f32_model(k: int, n: int, panels: np.ndarray | None) -> onnx.ModelProto:
    """MatMulF32 of x by panels: a constant when given, else an input `p`."""
    node = helper.make_node("MatMulF32", ["x", "p"], ["y"], domain=CUSTOM_DOMAIN, K=k, N=n)
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)]
    if panels is None:
        inputs.append(helper.make_tensor_value_info("p", onnx.TensorProto.FLOAT, None))
    graph = helper.make_graph([node], "f32", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [] if panels is None else [numpy_helper.from_array(panels, "p")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])


def test_the_op_is_built_where_the_cpu_has_avx512():
    from cann_llm.runtime.compatibility import cpu_features

    if {"avx512f", "avx512bw"} <= cpu_features():
        assert native.has_float32_panel_matmul()


@KERNEL
# (70, 1100): more pairs of panels than tasks, so a task takes several; decode reads a task's panels 4 at a
# time: 4 (576, 960), 4 then 1 (70, 1100), 4 and a last task's 3 (100, 1000), 2 (40, 290), 1 (1536, 40)
@pytest.mark.parametrize("k,n", [(576, 960), (64, 48), (33, 47), (1, 16), (1536, 40), (100, 1000), (70, 1100),
                                 (40, 290)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 12, 13, 25, 64])
def test_the_native_op_equals_the_product(k, n, rows, f32_library):
    w = _weight(k, n, seed=k + n)
    session = native_session(_f32_model(k, n, float32_panels.pack(w)), f32_library)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    assert_close_to_product(session.run(None, {"x": x})[0], x, w)


@KERNEL
def test_the_native_op_takes_any_leading_axes_and_no_rows():
    w = _weight(64, 48)
    session = native_session(_f32_model(64, 48, float32_panels.pack(w)))
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    y = session.run(None, {"x": x})[0]
    assert y.shape == (2, 3, 48)
    assert_close_to_product(y.reshape(6, 48), x.reshape(6, 64), w)
    assert session.run(None, {"x": np.zeros((0, 64), np.float32)})[0].shape == (0, 48)


@KERNEL
@pytest.mark.parametrize("x_shape,panels_shape,message", [
    ((1, 63), (3, 64, 16), "MatMulF32: A's last axis is not K"),
    ((1, 64), (2, 64, 16), r"MatMulF32: the panels are not \[ceil\(N/16\), K, 16\]"),
])
def test_the_native_op_refuses_operands_that_break_the_layout(x_shape, panels_shape, message):
    session = native_session(_f32_model(64, 48, None))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match=message):
        session.run(None, {"x": np.ones(x_shape, np.float32), "p": np.zeros(panels_shape, np.float32)})


@KERNEL
# from 17 panels a task reads several side by side, and the tensor ends in a chunk of 2 (3, 280), 3 (5, 1000)
# or 4 (3, 1100) panels
@pytest.mark.parametrize("k,n", [(1, 16), (1, 17), (2, 1), (3, 48), (4, 33), (64, 80), (5, 5), (3, 280), (5, 1000),
                                 (1, 1000), (3, 1100)])
def test_the_native_op_reads_nothing_past_its_operands(k, n, f32_library):
    w = _weight(k, n, seed=k * 100 + n)
    session = native_session(_f32_model(k, n, None), f32_library)
    keep: list = []
    panels = at_a_page_end(float32_panels.pack(w), keep)
    for rows in (1, 3, 4, 5, 13):
        x = at_a_page_end(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32), keep)
        assert_close_to_product(session.run(None, {"x": x, "p": panels})[0], x, w)


def test_the_reference_kernel_is_the_product():
    w = _weight(33, 47)
    x = np.random.default_rng(1).standard_normal((3, 33)).astype(np.float32)
    np.testing.assert_allclose(float32_panels.MatMulF32(x, float32_panels.pack(w), K=33, N=47), x @ w, rtol=1e-6, atol=1e-6)


def test_a_tied_heads_transpose_and_every_float_matmul_become_matmulf32(tmp_path):
    """A tied table too large for its transpose to be folded (as real vocabularies are): the head reads the table
    through a Transpose, which goes with it; the table itself stays for the embedding rows."""
    from cann_llm.models.tiny import tiny_onnx

    overrides = {"vocab_size": 70001}  # over 16 MiB of table: past FoldConstants' size threshold
    loaded = load_artifact(compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True, overrides=overrides),
                                      tmp_path / "m", enable_paged_attention=True))
    before = collections.Counter(node.op_type for node in loaded.model.graph.node)
    model, panels = _float32_panels(loaded.model, loaded.weights, loaded.om)
    after = collections.Counter(node.op_type for node in model.graph.node)
    assert before["MatMul"] > 0 and before["Transpose"] == 1
    assert after["MatMulF32"] == before["MatMul"] and after["MatMul"] == 0 and after["Transpose"] == 0
    head = next(node for node in model.graph.node if node.op_type == "MatMulF32" and node.input[1].endswith("/panels_t"))
    table = loaded.weights[head.input[1].removesuffix("/panels_t")]
    np.testing.assert_array_equal(float32_panels.unpack(panels[head.input[1]], K=table.shape[1], N=70001), table.T)
    assert set(panels) <= {t.name for t in model.graph.initializer}


@pytest.mark.parametrize("huge", [False, True])
def test_the_rewrite_keeps_what_else_reads_a_weight(huge):
    """A weight two MatMuls share is laid out once; a Transpose that is also a graph output stays, and so does a
    weight a subgraph reads; weights nothing reads any more go, from the inputs too where they are declared. The
    same in an arena of huge pages, sized for each weight (and transpose) once."""
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape).astype(np.float32)
               for name, shape in (("W", (8, 16)), ("T", (24, 8)), ("V", (8, 16)), ("U", (8, 16)))}
    stubs = []
    for name, value in weights.items():
        stub = onnx.TensorProto(name=name, dims=value.shape, data_type=onnx.TensorProto.FLOAT,
                                data_location=onnx.TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value="weights")
        stubs.append(stub)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "V"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1, 16])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m1"]), helper.make_node("MatMul", ["x", "W"], ["m2"]),
             helper.make_node("Transpose", ["T"], ["Tt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Tt"], ["m3"]),
             helper.make_node("MatMul", ["x", "V"], ["m4"]), helper.make_node("MatMul", ["x", "U"], ["m5"]),
             helper.make_node("If", ["c"], ["i"], then_branch=branch, else_branch=branch)]
    outputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
               for name in ("m1", "m2", "m3", "m4", "m5", "Tt", "i")]
    inputs = [x, helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
              helper.make_tensor_value_info("U", onnx.TensorProto.FLOAT, [8, 16])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, stubs))
    rewritten, panels = _float32_panels(model, weights, None, huge)
    ops = collections.Counter(node.op_type for node in rewritten.graph.node)
    assert ops == {"MatMulF32": 5, "Transpose": 1, "If": 1}
    assert sorted(panels) == ["T/panels_t", "U/panels", "V/panels", "W/panels"]
    np.testing.assert_array_equal(float32_panels.unpack(panels["T/panels_t"], K=8, N=24), weights["T"].T)
    for name in ("U", "V", "W"):
        np.testing.assert_array_equal(float32_panels.unpack(panels[f"{name}/panels"], K=8, N=16), weights[name])
    initializers = {t.name for t in rewritten.graph.initializer}
    assert initializers == {"T", "V", *panels}
    assert [value.name for value in rewritten.graph.input] == ["x", "c"]
    assert [n.input[1] for n in rewritten.graph.node if n.op_type == "MatMulF32"] == [
        "W/panels", "W/panels", "T/panels_t", "V/panels", "U/panels"]


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "phi3"])
def test_the_engine_on_panels_generates_as_transformers(family, tmp_path, monkeypatch):
    """On the native op where the CPU has it, and with the native matmuls off or the weights shared (onnxruntime's
    MatMul, pre-packed): transformers' greedy tokens every way."""
    from cann_llm.models.tiny import tiny_onnx

    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path / "cache"))  # share_weights' pre-packed weights
    om = compile_to(tiny_onnx(family, dynamo=True, with_past=True), tmp_path / "m", enable_paged_attention=True)
    prompts = mixed_prompts(8, seed=3)
    expected = hf_greedy(family, tuple(map(tuple, prompts)), 32)
    for options in ({}, {"native_matmul": False}, {"share_weights": True}):
        executor = Executor(load_artifact(om), **options)
        laid_out = [name for step in executor._steps for name in getattr(step, "_unpacked", {})]
        assert bool(laid_out) == (not options and native.has_float32_panel_matmul()), options
        with LLMEngine(om, max_batch_size=8, max_context_len=256, kv_cache_pages=32, max_num_batched_tokens=96,
                       **options) as engine:
            requests = [engine.submit(p, max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts]
            for request in requests:
                request.result()
            assert [request.output_ids for request in requests] == expected, options


def _anonymous_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("RssAnon:"))


def test_weights_laid_out_at_load_are_not_copied_by_onnxruntime(tmp_path):
    """The session uses the runtime's buffer as it is: onnxruntime copies an external initializer it is given,
    which would hold every float32 weight twice."""
    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.artifact import OmFile
    from cann_llm.runtime.executor import _made_at_load, _ort_session

    om = OmFile(compile_to(tiny_onnx("llama", dynamo=False, with_past=True), tmp_path / "m"))
    w = np.ones((64, 1 << 20), np.float32)  # 256 MiB, the only large thing made here
    stub = _made_at_load("w", w)
    # an op that reads the weight as it is (MatMul would pre-pack a copy of its own, as it does of any weight)
    graph = helper.make_graph([helper.make_node("Gather", ["w", "x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [stub])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    value = ort.OrtValue.ortvalue_from_numpy(w)
    before = _anonymous_mib()
    session = _ort_session(model, om, 1, spinning=False, unpacked={"w": value})
    assert _anonymous_mib() - before < 128
    assert session.run(None, {"x": np.array([5], np.int64)})[0][0, :3].tolist() == [1.0, 1.0, 1.0]
