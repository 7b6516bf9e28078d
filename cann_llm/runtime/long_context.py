"""Long documents in a short context: the document split into chunks of tokens that overlap, the chunks
ranked against the question by BM25 (bm25s), and the best kept within a token budget, in document order.

A 32K-token document and a 2K-token context: the model reads the few passages that share the question's
rarer words (and, budget left, what follows in the document), not the document's first 2K tokens.

`scoring="hybrid"` also ranks the chunks by the model's own token embeddings (each chunk and the question a
smooth-inverse-frequency weighted mean of its tokens' embedding rows, the component common to all chunks
removed: Arora et al., 2017), and fuses the two rankings by reciprocal rank (Cormack et al., 2009), so a
question worded unlike the document can still find its passage. It costs no model run: the rows are read
from the artifact's embedding table (`LLMEngine.embed_tokens`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import Stemmer

from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.tokenizer import TextTokenizer

# words matched by their stems ("refunds" finds "refund"), as bm25s recommends for English
_STEMMER = Stemmer.Stemmer("english")

SCORINGS = ("bm25", "hybrid")
SIF_A = 1e-3  # the smoothing of the inverse-frequency weights (the paper's recommended range is 1e-4 to 1e-3)
RRF_K = 60  # reciprocal rank fusion's constant, as its authors set it
GAP = "\n[…]\n"  # between passages that are not contiguous in the document
QUESTION_PROMPT = ("Answer the question using the passages from a document below.\n\n"
                   "Passages:\n{context}\n\nQuestion: {question}")


@dataclass(frozen=True)
class Chunk:
    """Tokens `start` to `end` (exclusive) of the document, its text and its score against a question (BM25's,
    or with hybrid scoring the fused reciprocal ranks)."""

    index: int
    start: int
    end: int
    text: str
    score: float = 0.0


@dataclass(frozen=True)
class Selection:
    """The passages kept for a question, in document order (overlapping chunks merged), and their tokens."""

    chunks: list[Chunk]
    tokens: int
    document_tokens: int
    num_chunks: int

    @property
    def text(self) -> str:
        """The passages as the model reads them, a gap mark between those not contiguous."""
        return GAP.join(chunk.text for chunk in self.chunks)


class LongContext:
    """`LongContext(tokenizer, chunk_tokens=256, overlap_tokens=32)`: `select(document, question, budget)`
    the passages to keep; `prompt(engine, document, question, reply_tokens)` the chat prompt that fits the
    engine's context with room for the reply. `scoring="hybrid"` with `embed` (token ids → their rows of
    the model's input embedding table, `LLMEngine.embed_tokens`) fuses BM25 with an embedding ranking."""

    def __init__(self, tokenizer: TextTokenizer, chunk_tokens: int = 256, overlap_tokens: int = 32,
                 scoring: str = "bm25", embed: Callable[[np.ndarray], np.ndarray] | None = None):
        if chunk_tokens < 1 or not 0 <= overlap_tokens < chunk_tokens:
            raise ValueError("chunk_tokens must be at least 1 and overlap_tokens in [0, chunk_tokens)")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, not {scoring!r}")
        if scoring == "hybrid" and embed is None:
            raise ValueError("hybrid scoring needs the model's token embeddings (embed)")
        self.tokenizer, self.chunk_tokens, self.overlap_tokens = tokenizer, chunk_tokens, overlap_tokens
        self.scoring, self.embed = scoring, embed

    def chunks(self, document: str) -> tuple[list[Chunk], list[tuple[int, int]]]:
        """The document's chunks (each `chunk_tokens`, the next starting `overlap_tokens` before the end of
        the last) and its tokens' character offsets."""
        chunks, _, offsets = self._split(document)
        return chunks, offsets

    def _split(self, document: str) -> tuple[list[Chunk], list[int], list[tuple[int, int]]]:
        ids, offsets = self.tokenizer.encode_with_offsets(document)
        step = self.chunk_tokens - self.overlap_tokens
        starts = range(0, max(len(ids) - self.overlap_tokens, 1), step)
        chunks = [Chunk(i, start, min(start + self.chunk_tokens, len(ids)), "") for i, start in enumerate(starts)]
        return [Chunk(c.index, c.start, c.end, _text(document, offsets, c.start, c.end)) for c in chunks], ids, offsets

    def select(self, document: str, question: str, budget_tokens: int) -> Selection:
        """The highest-scoring chunks whose tokens (overlaps counted once) fit `budget_tokens`, then, while
        room is left, the rest by score and position; merged and in document order."""
        chunks, ids, offsets = self._split(document)
        if not ids:
            return Selection([], 0, 0, 0)
        scores = _bm25(chunks, question)
        if self.scoring == "hybrid":
            similarity = _embedding_similarity(self.embed, [ids[c.start:c.end] for c in chunks],
                                               self.tokenizer.encode_with_offsets(question)[0])
            scores = _fused(scores, similarity)
        ranked = sorted(range(len(chunks)), key=lambda i: (-scores[i], i))
        covered: list[tuple[int, int]] = []
        used = 0
        for i in ranked:
            cost = _uncovered(covered, chunks[i].start, chunks[i].end)
            if cost and used + cost <= budget_tokens:
                covered.append((chunks[i].start, chunks[i].end))
                used += cost
        spans = _merged(covered)
        kept = [Chunk(n, start, end, _text(document, offsets, start, end),
                      max(scores[c.index] for c in chunks if c.start < end and c.end > start))
                for n, (start, end) in enumerate(spans)]
        return Selection(kept, used, len(offsets), len(chunks))

    def prompt(self, engine, document: str, question: str, reply_tokens: int) -> tuple[list[int], Selection]:
        """The chat prompt asking `question` over the passages of `document` that fit the engine's context
        with `reply_tokens` left, and the selection."""
        room = engine.max_context_len - reply_tokens - len(engine.chat_prompt(_messages("", question)))
        if room <= 0:
            raise SettingError("max_new_tokens", f"the question and a {reply_tokens}-token reply leave no room for "
                                                 f"the document in a {engine.max_context_len}-token context")
        budget = room
        while True:  # passages joined may tokenize a few tokens longer than counted apart
            selection = self.select(document, question, budget)
            ids = engine.chat_prompt(_messages(selection.text, question))
            if len(ids) + reply_tokens <= engine.max_context_len or budget <= 1:
                return ids, selection
            budget -= len(ids) + reply_tokens - engine.max_context_len


def _messages(context: str, question: str) -> list[dict]:
    return [{"role": "user", "content": QUESTION_PROMPT.format(context=context, question=question)}]


def _text(document: str, offsets: list[tuple[int, int]], start: int, end: int) -> str:
    return document[offsets[start][0]:offsets[end - 1][1]] if end > start else ""


@lru_cache(maxsize=1)
def _bm25s():
    """bm25s, imported on first use: it imports numba (its JIT, ~70 MB resident), which every `cann-run`
    process would otherwise carry for documents it is never given."""
    import bm25s

    # bm25s sets its own logger to DEBUG, past whatever level the application chose
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


def _bm25(chunks: list[Chunk], question: str) -> list[float]:
    """Each chunk's BM25 score against `question` (English stopwords left out); all 0 when nothing matches."""
    bm25s = _bm25s()
    (words,) = bm25s.tokenize([question], stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=False)
    if not words:
        return [0.0] * len(chunks)
    corpus = bm25s.tokenize([c.text for c in chunks], stopwords="en", stemmer=_STEMMER, show_progress=False)
    if not corpus.vocab:  # a document of whitespace, punctuation or stopwords: no word to match
        return [0.0] * len(chunks)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return [float(score) for score in retriever.get_scores(words)]


def _embedding_similarity(embed: Callable[[np.ndarray], np.ndarray], chunks: list[list[int]],
                          question: list[int]) -> list[float]:
    """Cosine of each chunk's smooth-inverse-frequency embedding to the question's, token frequencies
    counted over the chunks, the chunks' first principal component removed from all."""
    everything = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in (*chunks, question)])
    vocabulary, index = np.unique(everything, return_inverse=True)
    rows = np.asarray(embed(vocabulary), dtype=np.float64)
    counts = np.bincount(index[:-len(question)] if question else index, minlength=len(vocabulary))
    weighted = rows * (SIF_A / (SIF_A + counts / max(counts.sum(), 1)))[:, None]
    bounds = np.cumsum([0, *(len(ids) for ids in (*chunks, question))])
    vectors = np.stack([weighted[index[a:b]].mean(axis=0) if b > a else np.zeros(rows.shape[1])
                        for a, b in zip(bounds[:-1], bounds[1:])])
    vectors, query = vectors[:-1], vectors[-1]
    if len(chunks) > 1:
        common = np.linalg.svd(vectors, full_matrices=False)[2][0]
        vectors -= np.outer(vectors @ common, common)
        query = query - (query @ common) * common
    norms = np.linalg.norm(vectors, axis=1) * np.linalg.norm(query)
    return [float(x) for x in (vectors @ query) / np.maximum(norms, 1e-12)]


def _fused(*scorings: list[float]) -> list[float]:
    """Reciprocal rank fusion: each chunk's sum over the rankings of 1 / (RRF_K + its rank)."""
    fused = [0.0] * len(scorings[0])
    for scores in scorings:
        for rank, i in enumerate(sorted(range(len(scores)), key=lambda i: (-scores[i], i))):
            fused[i] += 1.0 / (RRF_K + rank + 1)
    return fused


def _uncovered(covered: list[tuple[int, int]], start: int, end: int) -> int:
    """Tokens of [start, end) outside every covered span."""
    taken = sum(max(0, min(end, b) - max(start, a)) for a, b in _merged(covered))
    return end - start - taken


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching spans joined, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
