"""The native matmuls' streamed weights read from huge pages (cann_llm/runtime/huge_pages.py, cann_llm/runtime/executor.py
`_in_huge_pages`): the kernel's setting read as it is, the copies exact and aligned, every native MatMulInt4
reading its copy (a tied head's table still read by the embedding lookup as it was), the artifact's pages of
each copied weight released, every MatMulF28 reading the artifact's own pages, which `atc` writes in whole huge
pages so that the page cache holds them in huge folios, every MatMulF32's panels laid out in one arena of huge
pages, and the engine generating the same tokens as without; none of it with the native matmuls off or the
weights shared."""

from __future__ import annotations

import collections
import io
import json

import numpy as np
import pytest
from conftest import compile_to

from cann_llm.runtime import artifact, huge_pages
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.executor import Executor, _in_huge_pages, _native_nodes
from cann_llm.runtime.kernels import native
from cann_llm.runtime.loader import load_artifact

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 2], [7, 1, 250, 33], list(range(3, 40))]
MATMUL = pytest.mark.skipif(not native.has_int8_matmul(), reason="no native MatMulInt4 on this CPU")
F28 = pytest.mark.skipif(not native.has_float28_matmul(), reason="no native MatMulF28 on this CPU")
PANELS = pytest.mark.skipif(not native.has_float32_panel_matmul(), reason="no native MatMulF32 on this CPU")


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
    arena = huge_pages.HugePageArena([array.nbytes for array in arrays])
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
    from cann_llm.models.tiny import tiny_onnx

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


def _mapped_kib(path, field: str = "Rss") -> int:
    """KiB of `path`'s pages this process holds mapped (`field`: Rss, or FilePmdMapped for those in huge pages)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0] and not line.split(" ", 1)[0].endswith(":"):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith(f"{field}:"):
                total += int(line.split()[1])
    return total


@MATMUL
def test_the_artifacts_pages_of_a_copied_weight_are_released(tmp_path):
    """A table large enough to be counted in pages (70,001 rows in 4 bits, over 1 MB), copied for the head."""
    from cann_llm.models.tiny import tiny_onnx

    conf = tmp_path / "head4.json"
    conf.write_text(json.dumps({"quant_mode": "INT4", "group_size": 128, "skip_layers": [], "lm_head_bits": 4,
                                "lm_head_group_size": 32}))
    om = compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True, overrides={"vocab_size": 70001}),
                    tmp_path / "m", enable_paged_attention=True, enable_compress_weight=True, compress_weight_conf=str(conf))
    loaded = load_artifact(om)
    table = next(node.input[1] for node in loaded.model.graph.node if node.op_type == "MatMulInt4"
                 and loaded.weights[node.input[1]].nbytes > 1_000_000)
    loaded.weights[table].sum()  # every page of it mapped, as running the head would map them
    before = _mapped_kib(om.resolve())
    _in_huge_pages(loaded.model, loaded.weights, _native_nodes(loaded.model), loaded.om)
    released = before - _mapped_kib(om.resolve())
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
    from cann_llm.runtime import executor as executor_module

    monkeypatch.setattr(executor_module, "huge_pages_given", lambda: True)
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path / "cache"))  # share_weights' pre-packed weights
    loaded = load_artifact(tied_int4)
    matmuls = {node.input[1] for node in loaded.model.graph.node if node.op_type == "MatMulInt4"}
    assert sorted(_copied(Executor(loaded))) == sorted(f"{name}/huge_pages" for name in matmuls)
    for options in ({"huge_pages": False}, {"native_matmul": False}, {"share_weights": True}):
        assert _copied(Executor(load_artifact(tied_int4), **options)) == [], options
    assert _tokens(tied_int4) == _tokens(tied_int4, huge_pages=False)


@pytest.fixture(scope="module")
def tied_f28(tmp_path_factory):
    """FP32 in 28 bits, paged, with a tied head."""
    from cann_llm.models.tiny import tiny_onnx

    return compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True), tmp_path_factory.mktemp("f28") / "m",
                      enable_paged_attention=True, compress_fp32_weight=True)


@F28
def test_every_native_f28_matmul_reads_the_artifacts_own_pages(tied_f28):
    loaded = load_artifact(tied_f28)
    matmuls = [node for node in loaded.model.graph.node if node.op_type == "MatMulF28"]
    model, given = _in_huge_pages(loaded.model, loaded.weights, _native_nodes(loaded.model), loaded.om)
    sources = {node.input[1] for node in matmuls}
    assert matmuls and sorted(given) == sorted(f"{source}/huge_pages" for source in sources)
    for name, view in given.items():  # no copy: the very bytes of the artifact's mapping
        assert view.__array_interface__ == loaded.weights[name.removesuffix("/huge_pages")].__array_interface__
    assert all(node.input[1] in given for node in model.graph.node if node.op_type == "MatMulF28")
    ops = collections.Counter(node.op_type for node in model.graph.node)
    assert ops == collections.Counter(node.op_type for node in loaded.model.graph.node)


@F28
def test_the_engine_generates_the_same_tokens_with_the_f28_panels_in_place(tied_f28, monkeypatch):
    from cann_llm.runtime import executor as executor_module

    monkeypatch.setattr(executor_module, "huge_pages_given", lambda: True)
    given = _copied(Executor(load_artifact(tied_f28)))
    assert given and all(name.removesuffix("/huge_pages") in load_artifact(tied_f28).weights for name in given)
    assert _copied(Executor(load_artifact(tied_f28), huge_pages=False)) == []
    assert _tokens(tied_f28) == _tokens(tied_f28, huge_pages=False)


def _panels(executor: Executor) -> dict[str, tuple[int, np.ndarray]]:
    """Each MatMulF32's panels as onnxruntime holds them: where they lie, and their values."""
    return {name: (value.data_ptr(), value.numpy()) for step in executor._steps
            for name, value in getattr(step, "_unpacked", {}).items() if "/panels" in name}


@PANELS
def test_float32_panels_are_laid_out_in_one_arena_of_huge_pages(tmp_path, monkeypatch):
    """Every MatMulF32's panels in one mapping that starts on a huge page, one after another, each on a cache
    line (numpy gives huge pages to arrays of 4 MB or more only: a decode step's smaller weights were left in
    small ones); elsewhere with the option off; the same values and the same tokens either way."""
    from cann_llm.runtime import executor as executor_module
    from cann_llm.models.tiny import tiny_onnx

    monkeypatch.setattr(executor_module, "huge_pages_given", lambda: True)
    om = compile_to(tiny_onnx("llama_tied", dynamo=True, with_past=True), tmp_path / "m", enable_paged_attention=True)
    together, apart_executor = Executor(load_artifact(om)), Executor(load_artifact(om), huge_pages=False)
    panels = _panels(together)  # views of the executors' memory: both kept alive to the end
    assert len(panels) > 2 and all(values.dtype == np.float32 for _, values in panels.values())
    spans = sorted((at, values.nbytes) for at, values in panels.values())
    assert spans[0][0] % huge_pages.huge_page_size() == 0 and all(at % 64 == 0 for at, _ in spans)
    assert all(0 <= later - (at + nbytes) < 64 for (at, nbytes), (later, _) in zip(spans, spans[1:]))
    apart = _panels(apart_executor)
    assert sorted(apart) == sorted(panels)
    for name, (at, values) in apart.items():
        assert not spans[0][0] <= at < spans[-1][0] + spans[-1][1]
        np.testing.assert_array_equal(values, panels[name][1])
    assert _tokens(om) == _tokens(om, huge_pages=False)


class _Recording(io.FileIO):
    """A real file that also records where each write lands and how long it is."""

    def __init__(self, path):
        super().__init__(path, "wb")
        self.writes: list[tuple[int, int]] = []

    def write(self, data):
        self.writes.append((self.tell(), len(memoryview(data).cast("B"))))
        return super().write(data)


def test_the_artifact_writer_writes_whole_huge_pages_at_huge_page_offsets(tmp_path):
    chunk = 1 << 12
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (5, 9000, 0, 4096, 1, 20000, 3)]
    with _Recording(tmp_path / "chunks") as file:
        whole = artifact._WholeChunks(file, chunk)
        for piece in pieces:
            whole.write(piece)
            assert whole.tell() == sum(len(p) for p in pieces[:pieces.index(piece) + 1])
        whole.flush()
    assert (tmp_path / "chunks").read_bytes() == b"".join(pieces)
    *middle, (last_at, _) = file.writes
    assert all(at % chunk == 0 and length % chunk == 0 for at, length in middle) and last_at % chunk == 0


def _huge_kib(path) -> int:
    """KiB of `path` mapped in huge pages when this process maps all of it and reads a byte of every page."""
    import mmap

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[::4096])
        return _mapped_kib(path, "FilePmdMapped")


def _artifact_and_control(folder):
    """An artifact of four 2.8 MB weights (none at a huge page's offset) written by `atc`'s writer, and a control:
    the same bytes written in one piece, the way a filesystem with large folios caches in huge folios."""
    import onnx
    from onnx import helper

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((700, 1000)).astype(np.float32) for _ in range(4)]
    graph = helper.make_graph([helper.make_node("Concat", [f"w{i}" for i in range(4)], ["y"], axis=0)], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    om = (folder / "m.om").resolve()
    artifact.write_artifact(om, helper.make_model(graph), {"name": "m"})
    control = om.with_name("control")
    control.write_bytes(om.read_bytes())
    return om, control


def _evicted(path) -> None:
    """`path`'s pages dropped from the page cache (none of them mapped or dirty), as after a reboot."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_an_artifact_lies_in_the_page_cache_in_huge_folios(tmp_path):
    """Where the filesystem caches a file written in one piece in huge folios (the control, written after it),
    the artifact's weights lie in huge folios too, written tensor by tensor as they are."""
    om, control = _artifact_and_control(tmp_path)
    if _huge_kib(control) == 0:
        pytest.skip("this filesystem or kernel caches no file in huge folios")
    assert _huge_kib(om) >= _huge_kib(control) - 2048


def test_an_artifact_read_back_from_disk_comes_in_huge_folios(tmp_path):
    """Evicted from the page cache, an artifact opened to serve (its header read, its weights' CRC checked) is
    read back in huge folios: its mapping asks for them before anything reads it."""
    import mmap

    om, control = _artifact_and_control(tmp_path)
    _evicted(control)
    with open(control, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        mapped.madvise(mmap.MADV_HUGEPAGE)
        sum(mapped[::4096])
    if _huge_kib(control) == 0:
        pytest.skip("this filesystem or kernel reads no file back in huge folios")
    _evicted(om)
    artifact.OmFile(om)
    assert _huge_kib(om) >= _huge_kib(control) - 2048
