"""The native ops (cann_llm/runtime/kernels/native, built here with the machine's C compiler) inside onnxruntime:
PagedAttention against the numpy reference of the same node on the same pages, SwiGlu against its numpy
kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from cann_llm.runtime.compatibility import cpu_features
from cann_llm.runtime.kernels import native
from cann_llm.runtime.kernels.paged_attention import PagedInputError
from cann_llm.runtime.lowering import POOL_KEY, POOL_VALUE, with_pool_inputs
from cann_llm.runtime.ops import CUSTOM_DOMAIN, PAGED_METADATA, PagedAttentionInput
from tests.runtime.test_paged_attention_kernels import (
    BAD_METADATA,
    DIM,
    HEADS,
    KV_HEADS,
    MIXES,
    PAGE,
    _decode_inputs,
    _node,
    _pool,
    _scattered_tables,
    _spoil,
)

LAYERS = 2
# where the library built here takes AVX-512's tiles, the AVX2 ones run from a second build (tests/conftest.py)
AVX2_BUILD = "avx512f" in cpu_features() and {"avx2", "fma"} <= cpu_features()


def _session(attrs: dict, packed: bool, rotary: bool) -> ort.InferenceSession:
    """A graph of one PagedAttention node on layer 1 of a two-layer pool, run by onnxruntime with the library."""
    width = (HEADS + 2 * KV_HEADS) * DIM if packed else HEADS * DIM
    names = {PagedAttentionInput.QUERY: "query"}
    inputs = [helper.make_tensor_value_info("query", onnx.TensorProto.FLOAT, [1, "T", width])]
    if not packed:
        names.update({PagedAttentionInput.KEY: "key", PagedAttentionInput.VALUE: "value"})
        inputs += [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, "T", KV_HEADS * DIM])
                   for n in ("key", "value")]
    if rotary:
        names.update({PagedAttentionInput.COS: "cos", PagedAttentionInput.SIN: "sin"})
        inputs += [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["T", "R"]) for n in ("cos", "sin")]
    for meta in PAGED_METADATA:
        names[meta.slot] = meta.name
        kind = onnx.TensorProto.INT64 if meta.dtype == np.int64 else onnx.TensorProto.INT32
        inputs.append(helper.make_tensor_value_info(meta.name, kind, list(meta.shape)))
    node_inputs = [names.get(slot, "") for slot in PagedAttentionInput]
    node = helper.make_node("PagedAttention", node_inputs, ["out"], domain=CUSTOM_DOMAIN, layer=1, page_size=PAGE,
                            **attrs)
    graph = helper.make_graph([node], "one_attention", inputs,
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native.library_path()))
    return ort.InferenceSession(with_pool_inputs(model).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _feeds(inputs, packed: bool, rotary: bool) -> dict[str, np.ndarray]:
    feeds = {"query": inputs[PagedAttentionInput.QUERY]}
    if not packed:
        feeds.update(key=inputs[PagedAttentionInput.KEY], value=inputs[PagedAttentionInput.VALUE])
    if rotary:
        feeds.update(cos=inputs[PagedAttentionInput.COS], sin=inputs[PagedAttentionInput.SIN])
    feeds.update({meta.name: np.asarray(inputs[meta.slot], meta.dtype) for meta in PAGED_METADATA})
    return feeds


def _step(mix, pages: int, packed: bool, rotary: int, seed: int = 5):
    """Inputs of one step of `mix` [(new tokens, context)], the pool's other pages random."""
    rng = np.random.default_rng(seed)
    lengths = [ctx for _, ctx in mix]
    tables = _scattered_tables(lengths, pages, seed)
    starts = np.concatenate([[0], np.cumsum([n for n, _ in mix])]).astype(np.int32)
    slots = np.concatenate([tables[b, np.arange(ctx - n, ctx) // PAGE] * PAGE + np.arange(ctx - n, ctx) % PAGE
                            for b, (n, ctx) in enumerate(mix)]).astype(np.int64)
    tokens = int(starts[-1])
    if packed:
        projections = [rng.standard_normal((1, tokens, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32), None, None]
    else:
        projections = [rng.standard_normal((1, tokens, w * DIM)).astype(np.float32) for w in (HEADS, KV_HEADS, KV_HEADS)]
    cos = sin = None
    if rotary:
        angles = rng.uniform(0, 6.3, (tokens, rotary)).astype(np.float32)
        cos, sin = np.cos(angles), np.sin(angles)
    return projections + [cos, sin, starts, np.asarray(lengths, np.int32), tables, slots]


def _two_layer_pool(pages: int):
    key, value = _pool(pages)
    other_key, other_value = _pool(pages, seed=9)
    return np.stack([other_key, key]), np.stack([other_value, value])


CASES = [(mix, packed, rotary, window) for mix in MIXES for packed, rotary, window in
         [(True, 0, 0), (False, DIM, 0), (True, DIM // 2, 0), (True, 0, 24)]]


@pytest.mark.parametrize("mix,packed,rotary,window", CASES)
def test_the_native_op_equals_the_reference_and_writes_the_same_pages(mix, packed, rotary, window):
    pages = 40
    inputs = _step(mix, pages, packed, rotary)
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, sliding_window=window)
    ref_key, ref_value = _pool(pages)
    expected = _node(inputs, ref_key, ref_value, fast=False, **attrs)
    pool_key, pool_value = _two_layer_pool(pages)
    untouched = pool_key[0].copy()
    session = _session(attrs, packed, bool(rotary))
    (out,) = session.run(None, {**_feeds(inputs, packed, bool(rotary)), POOL_KEY: pool_key, POOL_VALUE: pool_value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(pool_key[1], ref_key, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(pool_value[1], ref_value)
    np.testing.assert_array_equal(pool_key[0], untouched)


@pytest.mark.parametrize("mix", MIXES)
def test_a_softcap_caps_the_scores_alike_in_the_native_op_the_numba_kernel_and_the_reference(mix):
    """Gemma 2's c·tanh(s / c) on the scaled scores: decodes, prefill chunks and a mix of both."""
    pages = 40
    inputs = _step(mix, pages, True, 0)
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, softcap=1.5)
    expected = _node(inputs, *_pool(pages), fast=False, **attrs)
    assert not np.allclose(expected, _node(inputs, *_pool(pages), fast=False, **{**attrs, "softcap": 0.0}), atol=1e-3)
    np.testing.assert_allclose(_node(inputs, *_pool(pages), fast=True, **attrs), expected, atol=2e-5, rtol=0)
    pool_key, pool_value = _two_layer_pool(pages)
    (out,) = _session(attrs, True, False).run(None, {**_feeds(inputs, True, False), POOL_KEY: pool_key,
                                                     POOL_VALUE: pool_value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mix", MIXES)
def test_alibi_slopes_bias_the_scores_alike_in_the_native_op_the_numba_kernel_and_the_reference(mix):
    """ALiBi's m_h·(key position - query position) on each head's scaled scores (BLOOM, MPT, Falcon-RW):
    decodes, prefill chunks and a mix of both."""
    pages = 40
    inputs = _step(mix, pages, True, 0)
    slopes = [0.25 / 2 ** h for h in range(HEADS)]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2, alibi_slopes=slopes)
    expected = _node(inputs, *_pool(pages), fast=False, **attrs)
    assert not np.allclose(expected, _node(inputs, *_pool(pages), fast=False, **{**attrs, "alibi_slopes": []}),
                           atol=1e-3)
    np.testing.assert_allclose(_node(inputs, *_pool(pages), fast=True, **attrs), expected, atol=2e-5, rtol=0)
    pool_key, pool_value = _two_layer_pool(pages)
    (out,) = _session(attrs, True, False).run(None, {**_feeds(inputs, True, False), POOL_KEY: pool_key,
                                                     POOL_VALUE: pool_value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


def test_a_long_prefill_spread_over_threads_equals_the_reference():
    mix = [(300, 300), (1, 120)]
    inputs = _step(mix, 40, True, DIM)
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2)
    ref_key, ref_value = _pool(40)
    expected = _node(inputs, ref_key, ref_value, fast=False, **attrs)
    pool_key, pool_value = _two_layer_pool(40)
    (out,) = _session(attrs, True, True).run(None, {**_feeds(inputs, True, True), POOL_KEY: pool_key,
                                                     POOL_VALUE: pool_value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", BAD_METADATA, ids=list(BAD_METADATA))
def test_metadata_outside_the_pool_is_refused_before_any_page_is_touched(case):
    slot, value, message = BAD_METADATA[case]
    inputs = _spoil(_decode_inputs([20, 17], 8), slot, value)
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, head_dim=DIM, scale=0.2)
    pool_key, pool_value = _two_layer_pool(8)
    before = pool_key.copy(), pool_value.copy()
    with pytest.raises(Exception, match=f"PagedInputError: .*{message}") as raised:
        _session(attrs, True, False).run(None, {**_feeds(inputs, True, False), POOL_KEY: pool_key,
                                                POOL_VALUE: pool_value})
    assert not isinstance(raised.value, PagedInputError)  # onnxruntime's own exception: the executor converts it
    np.testing.assert_array_equal(pool_key, before[0])
    np.testing.assert_array_equal(pool_value, before[1])


def test_without_a_c_compiler_there_is_no_library_and_paged_artifacts_run_on_host_kernels(tmp_path):
    import subprocess
    import sys

    script = ("from cann_llm.runtime.kernels import native\n"
              "try:\n    native.library_path()\nexcept native.NativeUnavailable as why:\n    print('unavailable:', why)\n")
    env = {**__import__("os").environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "unavailable: no C compiler (set CC, or install gcc)"
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_where_the_library_cannot_be_built_the_executor_cuts_the_graph_at_the_attention(compiled, tmp_path, monkeypatch):
    from tests.passes.test_paged_kv_cache import _compile_paged

    from cann_llm.runtime import Executor

    _, loaded = _compile_paged(("llama", False, True, "sdpa"), compiled, tmp_path)
    layers = sum(n.op_type == "PagedAttention" for n in loaded.model.graph.node)

    def unavailable():
        raise native.NativeUnavailable("no C compiler (set CC, or install gcc)")

    monkeypatch.setattr(native, "library_path", unavailable)
    executor = Executor(loaded)
    assert executor.native_library is None and executor.num_segments == layers + 1


def test_a_failing_build_leaves_no_library_behind(tmp_path):
    import os
    import subprocess
    import sys

    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'cc: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    script = ("from cann_llm.runtime.kernels import native\n"
              "try:\n    native.library_path()\nexcept native.NativeUnavailable as why:\n    print('unavailable:', why)\n")
    env = {**os.environ, "CC": str(fake), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "unavailable: cc failed: cc: broken"
    assert not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.parametrize("build", ["native", "avx2"] if AVX2_BUILD else ["native"])
@pytest.mark.parametrize("shape", [(1, 1, 3072), (1, 37, 96), (2, 5, 8), (3, 4, 42)])  # halves past 16 and 8 lanes
def test_the_native_swiglu_equals_the_numpy_kernel(shape, build, request):
    from cann_llm.runtime.kernels.norms import SwiGlu

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, 120.0, -120.0, 0.0]  # NaN stays NaN; past exp's range SiLU is x or 0
    node = helper.make_node("SwiGlu", ["x"], ["y"], domain=CUSTOM_DOMAIN)
    graph = helper.make_graph([node], "swiglu", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    options = ort.SessionOptions()
    library = request.getfixturevalue("avx2_library") if build == "avx2" else native.library_path()
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    with np.errstate(over="ignore"):  # exp(120) is inf in numpy: SiLU(-120) is then -0, as it should be
        expected = SwiGlu(x)
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-6, equal_nan=True)
    assert np.isnan(y.reshape(-1)[0])


def test_the_native_plan_keeps_float32_swiglu_for_the_library_and_lowers_the_rest(compiled, tmp_path):
    from tests.passes.test_paged_kv_cache import _compile_paged

    from cann_llm.runtime.executor import _native_nodes
    from cann_llm.runtime.lowering import lower_for_onnxruntime

    _, loaded = _compile_paged(("llama", False, True, "sdpa"), compiled, tmp_path)
    layers = sum(n.op_type == "PagedAttention" for n in loaded.model.graph.node)
    kept = lower_for_onnxruntime(loaded.model, _native_nodes(loaded.model))
    assert sum(n.op_type == "SwiGlu" for n in kept.graph.node) == layers
    assert not any(n.op_type == "SwiGlu" for n in lower_for_onnxruntime(loaded.model).graph.node)


def _one_node_session(heads: int, kv_heads: int, dim: int, window: int = 0, page: int = PAGE,
                      rotary_interleaved: int | None = None, library: Path | None = None, slopes=()):
    """One PagedAttention node on packed [q | k | v]; with `rotary_interleaved` (0 or 1) it takes cos and sin,
    with `slopes` ALiBi's; run with `library` (default: the one built here)."""
    rotary = ["cos", "sin"] if rotary_interleaved is not None else ["", ""]
    node = helper.make_node("PagedAttention", ["qkv", "", "", *rotary, *(m.name for m in PAGED_METADATA)], ["out"],
                            domain=CUSTOM_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, head_dim=dim, scale=0.2,
                            layer=0, page_size=page, sliding_window=window, rotary_interleaved=rotary_interleaved or 0,
                            **({"alibi_slopes": list(slopes)} if len(slopes) else {}))
    inputs = [helper.make_tensor_value_info("qkv", onnx.TensorProto.FLOAT, [1, "T", (heads + 2 * kv_heads) * dim])]
    inputs += [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["T", dim]) for name in rotary if name]
    for meta in PAGED_METADATA:
        kind = onnx.TensorProto.INT64 if meta.dtype == np.int64 else onnx.TensorProto.INT32
        inputs.append(helper.make_tensor_value_info(meta.name, kind, list(meta.shape)))
    graph = helper.make_graph([node], "mqa", inputs, [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library or native.library_path()))
    return ort.InferenceSession(with_pool_inputs(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_many_query_heads_on_one_kv_head_attend_as_the_reference():
    from cann_llm.runtime.kernels.paged_attention import paged_attention_reference, rotate_and_store_reference

    heads, dim, pages = 20, 32, 8  # multi-query attention: 20 query heads read one KV head
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((1, 13, (heads + 2) * dim)).astype(np.float32)
    starts, lengths = np.array([0, 12, 13], np.int32), np.array([40, 30], np.int32)
    tables = np.array([[3, 0, 5], [1, 6, 7]], np.int32)
    positions = [np.arange(28, 40), np.array([29])]
    slots = np.concatenate([tables[b, p // PAGE] * PAGE + p % PAGE for b, p in enumerate(positions)]).astype(np.int64)
    key, value = (rng.standard_normal((1, pages, 1, PAGE, dim)).astype(np.float32) for _ in range(2))
    ref_key, ref_value = key[0].copy(), value[0].copy()
    q = rotate_and_store_reference(qkv, None, None, None, None, slots, ref_key, ref_value, num_heads=heads,
                                   kv_num_heads=1, head_dim=dim)
    expected = paged_attention_reference(q, ref_key, ref_value, starts, lengths, tables, 0.2).reshape(1, 13, -1)
    feeds = dict(zip((m.name for m in PAGED_METADATA), (starts, lengths, tables, slots)))
    (out,) = _one_node_session(heads, 1, dim).run(None, {"qkv": qkv, **feeds, POOL_KEY: key, POOL_VALUE: value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(key[0], ref_key, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads, window", [(9, 3, 0), (4, 4, 0), (6, 3, 0), (14, 2, 0), (6, 2, 21)])
def test_decode_tiles_of_whole_head_dim_vectors_attend_as_the_reference(dim, heads, kv_heads, window):
    """Head dims of 64 and 128 with fewer than 8 query vectors a tile (rows x the heads of a KV head: 1 to 7)
    take the narrow tile: sequences of one to three rows over several pages, one of them partly filled."""
    from cann_llm.runtime.kernels.paged_attention import paged_attention_reference, rotate_and_store_reference

    rng = np.random.default_rng(dim + heads)
    group = heads // kv_heads
    rows = [1, 2, 1, 3] if group <= 2 else [1, 1, 1, 1]
    lengths = np.array([70, 33, 16, 41], np.int32)
    pages = 24
    tables = rng.permutation(pages)[:4 * 5].reshape(4, 5).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    positions = [np.arange(ctx - n, ctx) for n, ctx in zip(rows, lengths)]
    slots = np.concatenate([tables[b, p // PAGE] * PAGE + p % PAGE for b, p in enumerate(positions)]).astype(np.int64)
    qkv = rng.standard_normal((1, int(starts[-1]), (heads + 2 * kv_heads) * dim)).astype(np.float32)
    key, value = (rng.standard_normal((1, pages, kv_heads, PAGE, dim)).astype(np.float32) for _ in range(2))
    ref_key, ref_value = key[0].copy(), value[0].copy()
    q = rotate_and_store_reference(qkv, None, None, None, None, slots, ref_key, ref_value, num_heads=heads,
                                   kv_num_heads=kv_heads, head_dim=dim)
    expected = paged_attention_reference(q, ref_key, ref_value, starts, lengths, tables, 0.2,
                                         sliding_window=window).reshape(1, int(starts[-1]), -1)
    feeds = dict(zip((m.name for m in PAGED_METADATA), (starts, lengths, tables, slots)))
    (out,) = _one_node_session(heads, kv_heads, dim, window).run(None, {"qkv": qkv, **feeds, POOL_KEY: key,
                                                                        POOL_VALUE: value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(key[0], ref_key, atol=1e-6, rtol=0)


def test_more_query_heads_on_a_kv_head_than_a_tile_holds_are_refused():
    feeds = dict(zip((m.name for m in PAGED_METADATA), (np.array([0, 1], np.int32), np.array([1], np.int32),
                                                        np.array([[0]], np.int32), np.array([0], np.int64))))
    pool = np.zeros((1, 1, 1, PAGE, 8), np.float32)
    with pytest.raises(Exception, match="PagedInputError: more than 128 query heads share one KV head"):
        _one_node_session(129, 1, 8).run(None, {"qkv": np.zeros((1, 1, 131 * 8), np.float32), **feeds,
                                                POOL_KEY: pool, POOL_VALUE: pool.copy()})


@pytest.mark.parametrize("build", ["native", "avx2"] if AVX2_BUILD else ["native"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads, window, interleaved", [(9, 3, 0, 0), (4, 4, 0, 1), (14, 2, 0, 0),
                                                                 (6, 2, 100, 0), (8, 8, 70, 1)])
def test_prefill_tiles_on_pages_of_128_attend_as_the_reference(dim, heads, kv_heads, window, interleaved, build, request):
    """The wide tile at the default page size: keys in blocks within a page, the blocks before a tile's first
    query unmasked, the rest masked (causal, and by the window), with rotary in both layouts. A whole prompt
    over three pages (the last part-filled), a chunk continuing one, and a decode row beside them; on an
    AVX-512 machine the AVX2 tiles too."""
    from cann_llm.runtime.kernels.paged_attention import paged_attention_reference, rotate_and_store_reference

    page, pages = 128, 12
    rng = np.random.default_rng(dim + heads + window)
    rows, lengths = [300, 45, 1], np.array([300, 203, 150], np.int32)
    tables = rng.permutation(pages)[:9].reshape(3, 3).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    positions = [np.arange(ctx - n, ctx) for n, ctx in zip(rows, lengths)]
    slots = np.concatenate([tables[b, p // page] * page + p % page for b, p in enumerate(positions)]).astype(np.int64)
    tokens = int(starts[-1])
    qkv = rng.standard_normal((1, tokens, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    angles = np.concatenate(positions)[:, None] * rng.uniform(0.001, 0.5, dim)[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    key, value = (rng.standard_normal((1, pages, kv_heads, page, dim)).astype(np.float32) for _ in range(2))
    ref_key, ref_value = key[0].copy(), value[0].copy()
    q = rotate_and_store_reference(qkv, None, None, cos, sin, slots, ref_key, ref_value, num_heads=heads,
                                   kv_num_heads=kv_heads, head_dim=dim, rotary_interleaved=interleaved)
    expected = paged_attention_reference(q, ref_key, ref_value, starts, lengths, tables, 0.2,
                                         sliding_window=window).reshape(1, tokens, -1)
    feeds = dict(zip((m.name for m in PAGED_METADATA), (starts, lengths, tables, slots)))
    library = request.getfixturevalue("avx2_library") if build == "avx2" else None
    session = _one_node_session(heads, kv_heads, dim, window, page, rotary_interleaved=interleaved, library=library)
    (out,) = session.run(None, {"qkv": qkv, "cos": cos, "sin": sin, **feeds, POOL_KEY: key, POOL_VALUE: value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(key[0], ref_key, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(value[0], ref_value)


def _decode_step_against_the_reference(rng, heads, kv_heads, dim, rows, lengths, tables, window, library, slopes=()):
    """One PagedAttention node over a pool of pages of 128 holding random keys and values, `rows` query rows
    ending each sequence of `lengths` (block tables `tables`, naming pages below tables.max() + 1), against
    the reference; with ALiBi's `slopes` when given."""
    from cann_llm.runtime.kernels.paged_attention import paged_attention_reference, rotate_and_store_reference

    page, pages = 128, int(tables.max()) + 1
    lengths = np.array(lengths, np.int32)
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    positions = [np.arange(ctx - n, ctx) for n, ctx in zip(rows, lengths)]
    slots = np.concatenate([tables[b, p // page] * page + p % page for b, p in enumerate(positions)]).astype(np.int64)
    tokens = int(starts[-1])
    qkv = rng.standard_normal((1, tokens, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    key, value = (rng.standard_normal((1, pages, kv_heads, page, dim)).astype(np.float32) for _ in range(2))
    ref_key, ref_value = key[0].copy(), value[0].copy()
    q = rotate_and_store_reference(qkv, None, None, None, None, slots, ref_key, ref_value, num_heads=heads,
                                   kv_num_heads=kv_heads, head_dim=dim)
    expected = paged_attention_reference(q, ref_key, ref_value, starts, lengths, tables, 0.2, sliding_window=window,
                                         alibi_slopes=np.asarray(slopes, np.float32)).reshape(1, tokens, -1)
    feeds = dict(zip((m.name for m in PAGED_METADATA), (starts, lengths, tables, slots)))
    session = _one_node_session(heads, kv_heads, dim, window, page, library=library, slopes=slopes)
    (out,) = session.run(None, {"qkv": qkv, **feeds, POOL_KEY: key, POOL_VALUE: value})
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("build", ["native", "avx2"] if AVX2_BUILD else ["native"])
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("heads, kv_heads, rows, window", [(9, 3, [1, 1, 1], 0), (4, 1, [1, 1, 1], 0),
                                                          (4, 2, [2, 1, 3], 0), (6, 2, [1, 2, 1], 300)])
def test_long_contexts_decoded_in_parts_attend_as_the_reference(dim, heads, kv_heads, rows, window, build, request):
    """A decode step of few sequences over long contexts: each one's keys cut into parts, one item each,
    merged after (the shortest sequence leaves its later parts empty; a window leaves early pages unread);
    one to three query rows a sequence, as a verified draft has; a head dim of 96 takes the generic tile."""
    rng = np.random.default_rng(dim + heads + len(rows))
    tables = rng.permutation(51).reshape(3, 17).astype(np.int32)
    library = request.getfixturevalue("avx2_library") if build == "avx2" else None
    _decode_step_against_the_reference(rng, heads, kv_heads, dim, rows, [2100, 700, 5], tables, window, library)


def test_long_contexts_decoded_in_parts_add_alibi_at_each_keys_own_position():
    """ALiBi over a context cut into parts (each part's keys at their positions in the whole context), and a
    window beside it."""
    rng = np.random.default_rng(11)
    tables = rng.permutation(51).reshape(3, 17).astype(np.int32)
    slopes = [2.0 ** -(h + 1) / 8 for h in range(6)]
    _decode_step_against_the_reference(rng, 6, 2, 64, [1, 2, 1], [2100, 700, 5], tables, 0, None, slopes)
    _decode_step_against_the_reference(rng, 6, 2, 64, [1, 1, 1], [2100, 700, 5], tables, 300, None, slopes)


@pytest.mark.parametrize("build", ["native", "avx2"] if AVX2_BUILD else ["native"])
@pytest.mark.parametrize("heads, kv_heads, rows, lengths, window", [
    (9, 3, [1], [600], 0), (9, 3, [1], [530], 0), (9, 3, [1], [900], 600), (6, 3, [3], [700], 0),
    (9, 3, [2], [700], 600), (4, 1, [1, 1], [700, 41], 0), (4, 1, [1, 1], [700, 41], 520)])
def test_decode_contexts_cut_within_pages_attend_as_the_reference(heads, kv_heads, rows, lengths, window, build,
                                                                   request):
    """A step of at most three items (a sequence's KV heads), fewer than any pool's threads want: each
    item's keys are cut into parts of even length that begin and end inside pages (600 keys in two parts
    of 304 and 296; under a window of 600 they start where it does, mid-page), with one to three query rows
    a sequence, as a verified draft has; the shorter sequence's later parts hold nothing it sees."""
    rng = np.random.default_rng(sum(lengths) + window + sum(rows))
    tables = rng.permutation(16).reshape(2, 8)[:len(lengths)].astype(np.int32)
    library = request.getfixturevalue("avx2_library") if build == "avx2" else None
    _decode_step_against_the_reference(rng, heads, kv_heads, 64, rows, lengths, tables, window, library)
