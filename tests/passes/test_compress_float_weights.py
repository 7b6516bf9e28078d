"""`--compress_fp32_weight` (cann_llm/passes/compress_float_weights.py): every float32 MatMul of a tiny export becomes a
MatMulF28, a tied lm_head's through its Transpose with the embedding Gather still reading the float32 table,
and the engine generates transformers' greedy tokens from the artifact, on the native op and on onnxruntime's
MatMul over the unpacked weights."""

from __future__ import annotations

import collections

import pytest
from conftest import compile_to
from generation_utils import hf_greedy, mixed_prompts

from cann_llm import LLMEngine
from cann_llm.runtime.artifact import OmFile


def _op_counts(om) -> collections.Counter:
    return collections.Counter(node.op_type for node in OmFile(om).graph().graph.node)


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "phi3"])
def test_every_float_matmul_is_stored_in_28_bits_and_generates_as_transformers(family, tmp_path):
    from cann_llm.models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=True, with_past=True)
    plain = _op_counts(compile_to(source, tmp_path / "plain", enable_paged_attention=True))
    om = compile_to(source, tmp_path / "f28", enable_paged_attention=True, compress_fp32_weight=True)
    compressed = _op_counts(om)
    assert plain["MatMul"] > 0
    assert compressed["MatMulF28"] == plain["MatMul"] and compressed["MatMul"] == 0
    assert compressed["Gather"] == plain["Gather"]  # the tiny tied head's transpose is folded: a table of its own
    # the kernel's CPU feature is recorded as preferred: without it the weights are unpacked at load (W13001)
    assert ["avx512vbmi"] in OmFile(om).metadata["requires"]["isa"]["preferred"]["x86_64"]
    assert ["avx512vbmi"] not in OmFile(tmp_path / "plain.om").metadata["requires"]["isa"]["preferred"]["x86_64"]
    prompts = mixed_prompts(8, seed=3)
    expected = hf_greedy(family, tuple(map(tuple, prompts)), 32)
    for native_matmul in (True, False):
        with LLMEngine(om, max_batch_size=8, max_context_len=256, kv_cache_pages=32, max_num_batched_tokens=96,
                       native_matmul=native_matmul) as engine:
            requests = [engine.submit(p, max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts]
            for request in requests:
                request.result()
            assert [request.output_ids for request in requests] == expected


def test_a_tied_table_is_stored_once_and_its_rows_read_from_the_heads_panels(tmp_path):
    """A tied table too large to fold its transpose (as real vocabularies are): the head's MatMul and the
    embedding lookup share the packed weight, the artifact holds no float32 copy, and the rows read out of
    the graph (cann_llm/runtime/embedding_rows.py) are the table's bit for bit, with the table's refusals."""
    import numpy as np
    from onnx import numpy_helper

    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.kernels import float28
    from cann_llm.runtime.ops import attributes
    from cann_llm.runtime.embedding_rows import PackedColumns, split_off
    from cann_llm.runtime.errors import AtcError
    from cann_llm.runtime.loader import load_artifact

    overrides = {"vocab_size": 70001}  # over 16 MiB of table: past FoldConstants' size threshold; a part-filled last panel
    source = tiny_onnx("llama_tied", dynamo=True, with_past=True, overrides=overrides)
    plain = compile_to(source, tmp_path / "plain", enable_paged_attention=True)
    om = compile_to(source, tmp_path / "f28", enable_paged_attention=True, compress_fp32_weight=True)
    counts = _op_counts(om)
    assert counts["GatherF28"] == 1 and counts["MatMulF28"] == _op_counts(plain)["MatMul"]
    assert om.stat().st_size < plain.stat().st_size * 0.9  # the table's bytes once, in 28 bits
    loaded, reference = load_artifact(om), load_artifact(plain)
    table = next(reference.weights[n.input[0]] for n in reference.model.graph.node
                 if n.op_type == "Gather" and n.input[1] == "input_ids")
    _, (gathered,) = split_off(loaded.model, loaded.weights, loaded.om)
    assert isinstance(gathered.rows, PackedColumns)
    ids = np.array([[0, 5, 5, 70000, -1], [17, 16, 15, -70001, 69999]], np.int64)
    np.testing.assert_array_equal(gathered.rows(ids).view(np.uint32), np.take(table, ids, axis=0).view(np.uint32))
    with pytest.raises(AtcError, match="E10001"):
        gathered.rows(np.array([70001], np.int64))
    # the reference backend's kernel of the node gives the same rows
    node = next(n for n in loaded.model.graph.node if n.op_type == "GatherF28")
    inline = {t.name: numpy_helper.to_array(t) for t in loaded.model.graph.initializer if t.name not in loaded.weights}
    operands = [loaded.weights.get(name, inline.get(name)) for name in node.input[:4]]
    rows = float28.GatherF28(*operands, ids, **attributes(node))
    np.testing.assert_array_equal(rows.view(np.uint32), np.take(table, ids, axis=0).view(np.uint32))
    prompts = mixed_prompts(4, seed=4)
    expected = hf_greedy("llama_tied", tuple(map(tuple, prompts)), 16, overrides=overrides)
    with LLMEngine(om, max_batch_size=4, max_context_len=256, kv_cache_pages=16) as engine:
        requests = [engine.submit(p, max_new_tokens=16, temperature=0, ignore_eos=True) for p in prompts]
        for request in requests:
            request.result()
        assert [request.output_ids for request in requests] == expected


@pytest.mark.parametrize("backend", ["onnxruntime", "reference"])
def test_a_contiguous_artifact_reproduces_onnxruntime_on_the_export(backend, tmp_path):
    """Without a paged cache too: the native op where the CPU has it (nothing unpacked), else the unpacked
    weights; the reference backend's numpy kernel; each within float32 rounding of onnxruntime on the export."""
    import numpy as np
    from conftest import ort_reference

    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime import Executor, load_artifact
    from cann_llm.runtime.feeds import causal_lm_inputs
    from cann_llm.runtime.kernels import native

    source = tiny_onnx("qwen2", dynamo=False, with_past=True)
    loaded = load_artifact(compile_to(source, tmp_path / "m", compress_fp32_weight=True))
    executor = Executor(loaded, backend)
    if backend == "onnxruntime":
        given = [name for step in executor._steps for name in getattr(step, "_unpacked", {})]
        # the native op's panels are given as the artifact's own pages, under names of their own
        unpacked = [name for name in given if not name.endswith("/huge_pages")]
        assert bool(unpacked) != native.has_float28_matmul()
    dims = loaded.metadata["model"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, dims["vocab_size"], (2, 5), dtype=np.int64)
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, 3, rng)
    want, got = ort_reference(source, feeds), executor.run(feeds)
    for output in want:
        np.testing.assert_allclose(got[output], want[output], rtol=0, atol=1e-4, err_msg=output)
