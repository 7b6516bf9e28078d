"""`--compress_fp32_weight` (passes/compress_float_weights.py): every float32 MatMul of a tiny export becomes a
MatMulF28, a tied lm_head's through its Transpose with the embedding Gather still reading the float32 table,
and the engine generates transformers' greedy tokens from the artifact, on the native op and on onnxruntime's
MatMul over the unpacked weights."""

from __future__ import annotations

import collections

import pytest
from conftest import compile_to
from generation_utils import hf_greedy, mixed_prompts

from cann_llm import LLMEngine
from runtime.artifact import OmFile


def _op_counts(om) -> collections.Counter:
    return collections.Counter(node.op_type for node in OmFile(om).graph().graph.node)


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "phi3"])
def test_every_float_matmul_is_stored_in_28_bits_and_generates_as_transformers(family, tmp_path):
    from models.tiny import tiny_onnx

    source = tiny_onnx(family, dynamo=True, with_past=True)
    plain = _op_counts(compile_to(source, tmp_path / "plain", enable_paged_attention=True))
    om = compile_to(source, tmp_path / "f28", enable_paged_attention=True, compress_fp32_weight=True)
    compressed = _op_counts(om)
    assert plain["MatMul"] > 0
    assert compressed["MatMulF28"] == plain["MatMul"] and compressed["MatMul"] == 0
    assert compressed["Gather"] == plain["Gather"]  # a tied table's lookup reads the float32 original
    prompts = mixed_prompts(8, seed=3)
    expected = hf_greedy(family, tuple(map(tuple, prompts)), 32)
    for native_matmul in (True, False):
        with LLMEngine(om, max_batch_size=8, max_context_len=256, kv_cache_pages=32, max_num_batched_tokens=96,
                       native_matmul=native_matmul) as engine:
            requests = [engine.submit(p, max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts]
            for request in requests:
                request.result()
            assert [request.output_ids for request in requests] == expected
