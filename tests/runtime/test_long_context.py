"""Long documents in a short context (cann_llm/runtime/long_context.py): chunks of tokens that overlap, BM25 ranking,
the budget held, and the needle test: a fact placed at 10 depths of a 32K-token document of held-out prose
is among the passages kept for a question about it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm.models.tiny import byte_tokenizer_json
from cann_llm.runtime.long_context import GAP, LongContext
from cann_llm.runtime.tokenizer import TextTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from needle import NEEDLE, QUESTION, needle_document  # noqa: E402

PROSE = (Path(__file__).resolve().parents[2] / "cann_llm" / "models" / "data" / "eval.txt").read_text()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path) -> TextTokenizer:
    return TextTokenizer({name: (smollm2_path.parent / name).read_text()
                          for name in ("tokenizer.json", "tokenizer_config.json")})


def test_the_needle_is_kept_at_every_depth_of_a_32k_token_document(smollm2_tokenizer):
    long_context = LongContext(smollm2_tokenizer)
    found = []
    for depth in [i / 10 + 0.05 for i in range(10)]:
        document = needle_document(smollm2_tokenizer, 32_768, depth)
        selection = long_context.select(document, QUESTION, 1_900)
        assert selection.document_tokens >= 32_768 and selection.tokens <= 1_900
        found.append(NEEDLE in selection.text)
    assert sum(found) >= 9, found


def test_chunks_overlap_cover_the_document_and_the_budget_holds():
    tokenizer = TextTokenizer({"tokenizer.json": byte_tokenizer_json()})  # a token a byte: easy to count
    document = PROSE[:5000]
    long_context = LongContext(tokenizer, chunk_tokens=100, overlap_tokens=20)
    chunks, _ = long_context.chunks(document)
    assert chunks[0].start == 0 and chunks[-1].end == len(document.encode())
    assert all(b.start == a.end - 20 and a.end - a.start == 100 for a, b in zip(chunks, chunks[1:]))
    selection = long_context.select(document, "whatever the question", 333)
    assert selection.tokens <= 333 and sum(len(c.text.encode()) for c in selection.chunks) == selection.tokens
    assert [c.start for c in selection.chunks] == sorted(c.start for c in selection.chunks)
    assert all(a.end < b.start for a, b in zip(selection.chunks, selection.chunks[1:]))  # merged when they touch
    assert selection.text == GAP.join(c.text for c in selection.chunks)
    # nothing to match (stopwords only): the budget is filled from the document's start
    assert long_context.select(document, "the of and", 150).chunks[0].start == 0


def test_the_prompt_fits_the_engine_with_room_for_the_reply(tmp_path_factory):
    from cann_llm.runtime.engine.engine import LLMEngine

    om = compile_tiny_chat_model(tmp_path_factory, "{% for m in messages %}{{ m['content'] }}{% endfor %}", "long")
    with LLMEngine(om, max_context_len=400, kv_cache_pages=8) as engine:
        long_context = LongContext(engine.tokenizer, chunk_tokens=64, overlap_tokens=8)
        document = PROSE[:3000] + " " + NEEDLE + " " + PROSE[3000:6000]
        ids, selection = long_context.prompt(engine, document, QUESTION, 32)
        assert len(ids) + 32 <= 400 and NEEDLE in selection.text
        with pytest.raises(ValueError, match="no room for the document"):
            long_context.prompt(engine, document, QUESTION, 399)


PARAPHRASE = "Which password does the port administration use?"  # no word shared with the needle


def _smollm2_embeddings(smollm2_path):
    """The exported model's input embedding table, as `LLMEngine.embed_tokens` serves it."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(smollm2_path))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    table = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == gather.input[0]),
                                  base_dir=str(smollm2_path.parent))
    return lambda ids: table[ids]


def test_hybrid_scoring_finds_a_paraphrased_question_where_bm25_alone_does_less(smollm2_tokenizer, smollm2_path):
    embed = _smollm2_embeddings(smollm2_path)
    kept = {}
    documents = [needle_document(smollm2_tokenizer, 32_768, i / 10 + 0.05) for i in range(10)]
    for scoring in ("bm25", "hybrid"):
        long_context = LongContext(smollm2_tokenizer, scoring=scoring, embed=embed)
        for question in (QUESTION, PARAPHRASE):
            kept[scoring, question] = sum(NEEDLE in long_context.select(d, question, 1_900).text for d in documents)
    assert kept["hybrid", QUESTION] >= 9
    assert kept["hybrid", PARAPHRASE] > kept["bm25", PARAPHRASE], kept
    with pytest.raises(ValueError, match="embeddings"):
        LongContext(smollm2_tokenizer, scoring="hybrid")
    with pytest.raises(ValueError, match="scoring"):
        LongContext(smollm2_tokenizer, scoring="dense")


def test_embed_tokens_reads_float_and_int4_tables_alike(tmp_path_factory):
    """An INT4 artifact's embedding rows (GatherInt4) come back dequantized, within the quantization step."""
    import json

    import numpy as np

    from conftest import compile_to
    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.runtime.loader import load_artifact

    model = tiny_onnx("llama_tied", dynamo=True, with_past=True)
    folder = tmp_path_factory.mktemp("embed")
    (folder / "int4.json").write_text(json.dumps({"quant_mode": "INT4", "group_size": 32, "skip_layers": [], "lm_head_bits": 4,
                                                  "lm_head_group_size": 32}))
    exact = load_artifact(compile_to(model, folder / "fp32", enable_paged_attention=True))
    packed = load_artifact(compile_to(model, folder / "int4", enable_paged_attention=True,
                                      compress_weight_conf=str(folder / "int4.json")))
    assert any(n.op_type == "GatherInt4" for n in packed.model.graph.node)
    ids = np.array([0, 7, 255, 7])
    rows, approx = exact.embed_tokens(ids), packed.embed_tokens(ids)
    table = next(exact.weights[n.input[0]] for n in exact.model.graph.node if n.op_type == "Gather"
                 and n.input[1] == "input_ids")
    np.testing.assert_array_equal(rows, table[ids])
    assert rows.shape == approx.shape == (4, 64) and approx.dtype == np.float32
    step = np.abs(rows).max(axis=1, keepdims=True) / 7  # symmetric 4-bit: half a step at most, per group
    assert np.all(np.abs(approx - rows) <= step) and not np.array_equal(approx, rows)
