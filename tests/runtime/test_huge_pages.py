"""The native matmuls' streamed weights copied at load into huge pages (runtime/huge_pages.py,
runtime/executor.py `_in_huge_pages`): the kernel's setting read as it is, the copies exact and aligned, every
native MatMulInt4 reading its copy (a tied head's table still read by the embedding lookup as it was), the
artifact's pages of each copied weight released, and the engine generating the same tokens as without the
copies; none made with the native matmuls off or the weights shared."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from conftest import compile_to

from runtime import huge_pages
from runtime.engine.engine import LLMEngine
from runtime.executor import Executor, _in_huge_pages, _native_nodes
from runtime.kernels import native
from runtime.loader import load_artifact

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 2], [7, 1, 250, 33], list(range(3, 40))]
MATMUL = pytest.mark.skipif(not native.has_int8_matmul(), reason="no native MatMulInt4 on this CPU")


@pytest.mark.parametrize("text,expected", [("always [madvise] never\n", True), ("[always] madvise never\n", True),
                                           ("always madvise [never]\n", False), (None, False)])
def test_huge_pages_are_used_where_the_kernel_gives_them(tmp_path, text, expected):
    if text is not None:
        (tmp_path / "enabled").write_text(text)
    assert huge_pages.huge_pages_given(tmp_path) is expected


def test_a_huge_page_is_the_kernels_pmd_size(tmp_path):
    assert huge_pages.huge_page_size(tmp_path) == 2 << 20  # where the kernel does not say
    (tmp_path / "hpage_pmd_size").write_text("536870912\n")  # arm64 with 64 KB pages
    assert huge_pages.huge_page_size(tmp_path) == 512 << 20


def test_the_arena_holds_exact_copies_each_on_a_cache_line():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (129, 3, 7), dtype=np.uint8), rng.standard_normal((33, 5)).astype(np.float32),
              rng.integers(0, 256, 1, dtype=np.uint8), np.arange(1000, dtype=np.int32)]
    arena = huge_pages.HugePageArena(arrays)
    copies = [arena.copy(array) for array in arrays]
    assert copies[0].ctypes.data % huge_pages.huge_page_size() == 0
    for array, copy in zip(arrays, copies):
        assert copy.dtype == array.dtype and copy.shape == array.shape
        assert copy.ctypes.data % 64 == 0 and not np.shares_memory(copy, array)
        np.testing.assert_array_equal(copy, array)  # each still whole once all are copied: none overlaps another
    with pytest.raises(ValueError, match="bytes left"):  # the arrays it was made for, no more
        arena.copy(np.zeros(huge_pages.huge_page_size(), np.uint8))


@pytest.fixture(scope="module")
def tied_int4(tmp_path_factory):
    """INT4 with the tied head in 4 bits, as the peers' artifact: one table the head's MatMulInt4 and the
    embedding's GatherInt4 both read."""
    from models.tiny import tiny_onnx

    folder = tmp_path_factory.mktemp("huge")
    conf = folder / "head4.json"
    conf.write_text(json.dumps({"quant_mode": "INT4", "group_size": 128, "skip_layers": [], "lm_head_bits": 4,
                                "lm_head_group_size": 32}))
    return compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True), folder / "m", enable_paged_attention=True,
                      enable_compress_weight=True, compress_weight_conf=str(conf))


@MATMUL
def test_every_native_matmul_reads_its_copy_and_the_embedding_the_table(tied_int4):
    loaded = load_artifact(tied_int4)
    keep = _native_nodes(loaded.model)
    matmuls = [node for node in loaded.model.graph.node if node.op_type == "MatMulInt4"]
    assert matmuls and all(keep(node) for node in matmuls)
    model, copies = _in_huge_pages(loaded.model, loaded.weights, keep, loaded.om)
    sources = {node.input[1] for node in matmuls}
    assert sorted(copies) == sorted(f"{source}/huge_pages" for source in sources)
    for name, copy in copies.items():
        np.testing.assert_array_equal(copy, loaded.weights[name.removesuffix("/huge_pages")])
    ops = collections.Counter(node.op_type for node in model.graph.node)
    assert ops == collections.Counter(node.op_type for node in loaded.model.graph.node)
    assert all(node.input[1] in copies for node in model.graph.node if node.op_type == "MatMulInt4")
    gather = next(node for node in model.graph.node if node.op_type == "GatherInt4")
    assert f"{gather.input[0]}/huge_pages" in copies  # the tied table: copied for the head, the original kept
    initializers = {t.name for t in model.graph.initializer}
    assert initializers == ({t.name for t in loaded.model.graph.initializer} - sources) | set(copies) | {gather.input[0]}


def _om_resident_kib(path) -> int:
    """KiB of the artifact file's pages this process holds mapped."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0] and not line.split(" ", 1)[0].endswith(":"):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@MATMUL
def test_the_artifacts_pages_of_a_copied_weight_are_released(tmp_path):
    """A table large enough to be counted in pages (70,001 rows in 4 bits, over 1 MB), copied for the head."""
    from models.tiny import tiny_onnx

    conf = tmp_path / "head4.json"
    conf.write_text(json.dumps({"quant_mode": "INT4", "group_size": 128, "skip_layers": [], "lm_head_bits": 4,
                                "lm_head_group_size": 32}))
    om = compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True, overrides={"vocab_size": 70001}),
                    tmp_path / "m", enable_paged_attention=True, enable_compress_weight=True, compress_weight_conf=str(conf))
    loaded = load_artifact(om)
    table = next(node.input[1] for node in loaded.model.graph.node if node.op_type == "MatMulInt4"
                 and loaded.weights[node.input[1]].nbytes > 1_000_000)
    loaded.weights[table].sum()  # every page of it mapped, as running the head would map them
    before = _om_resident_kib(om.resolve())
    _in_huge_pages(loaded.model, loaded.weights, _native_nodes(loaded.model), loaded.om)
    released = before - _om_resident_kib(om.resolve())
    # nearly all of it (not the pages it shares with its neighbours); without the release, none
    assert released >= 0.9 * loaded.weights[table].nbytes / 1024


def _copied(executor: Executor) -> list[str]:
    return [name for step in executor._steps for name in getattr(step, "_unpacked", {}) if name.endswith("/huge_pages")]


def _tokens(om, **settings):
    with LLMEngine(om, max_batch_size=4, max_context_len=128, kv_cache_pages=16, **settings) as engine:
        requests = [engine.submit(p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in PROMPTS]
        for request in requests:
            request.result()
        return [list(request.output_ids) for request in requests]


@MATMUL
def test_the_engine_generates_the_same_tokens_with_and_without_the_copies(tied_int4, tmp_path, monkeypatch):
    """Every MatMulInt4 copied by default where the kernel gives huge pages (the copies made here either way:
    where it gives none they stand in small pages), none with the option off, the native matmuls off or the
    weights shared; the same tokens with the copies as without."""
    import runtime.executor

    monkeypatch.setattr(runtime.executor, "huge_pages_given", lambda: True)
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path / "cache"))  # share_weights' pre-packed weights
    loaded = load_artifact(tied_int4)
    matmuls = {node.input[1] for node in loaded.model.graph.node if node.op_type == "MatMulInt4"}
    assert sorted(_copied(Executor(loaded))) == sorted(f"{name}/huge_pages" for name in matmuls)
    for options in ({"huge_pages": False}, {"native_matmul": False}, {"share_weights": True}):
        assert _copied(Executor(load_artifact(tied_int4), **options)) == [], options
    assert _tokens(tied_int4) == _tokens(tied_int4, huge_pages=False)
