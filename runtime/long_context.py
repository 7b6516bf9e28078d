"""Long documents in a short context: the document split into chunks of tokens that overlap, the chunks
ranked against the question by BM25 (bm25s), and the best kept within a token budget, in document order.

A 32K-token document and a 2K-token context: the model reads the few passages that share the question's
rarer words (and, budget left, what follows in the document), not the document's first 2K tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import bm25s
import Stemmer

from runtime.tokenizer import TextTokenizer

# bm25s sets its own logger to DEBUG, past whatever level the application chose
logging.getLogger("bm25s").setLevel(logging.WARNING)
# words matched by their stems ("refunds" finds "refund"), as bm25s recommends for English
_STEMMER = Stemmer.Stemmer("english")

GAP = "\n[…]\n"  # between passages that are not contiguous in the document
QUESTION_PROMPT = ("Answer the question using the passages from a document below.\n\n"
                   "Passages:\n{context}\n\nQuestion: {question}")


@dataclass(frozen=True)
class Chunk:
    """Tokens `start` to `end` (exclusive) of the document, its text and its BM25 score against a question."""

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
    engine's context with room for the reply."""

    def __init__(self, tokenizer: TextTokenizer, chunk_tokens: int = 256, overlap_tokens: int = 32):
        if chunk_tokens < 1 or not 0 <= overlap_tokens < chunk_tokens:
            raise ValueError("chunk_tokens must be at least 1 and overlap_tokens in [0, chunk_tokens)")
        self.tokenizer, self.chunk_tokens, self.overlap_tokens = tokenizer, chunk_tokens, overlap_tokens

    def chunks(self, document: str) -> tuple[list[Chunk], list[tuple[int, int]]]:
        """The document's chunks (each `chunk_tokens`, the next starting `overlap_tokens` before the end of
        the last) and its tokens' character offsets."""
        ids, offsets = self.tokenizer.encode_with_offsets(document)
        step = self.chunk_tokens - self.overlap_tokens
        starts = range(0, max(len(ids) - self.overlap_tokens, 1), step)
        chunks = [Chunk(i, start, min(start + self.chunk_tokens, len(ids)), "") for i, start in enumerate(starts)]
        return [Chunk(c.index, c.start, c.end, _text(document, offsets, c.start, c.end)) for c in chunks], offsets

    def select(self, document: str, question: str, budget_tokens: int) -> Selection:
        """The highest-scoring chunks whose tokens (overlaps counted once) fit `budget_tokens`, then, while
        room is left, the rest by score and position; merged and in document order."""
        chunks, offsets = self.chunks(document)
        scores = _bm25(chunks, question)
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
            raise ValueError(f"the question and a {reply_tokens}-token reply leave no room for the document "
                             f"in a {engine.max_context_len}-token context")
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


def _bm25(chunks: list[Chunk], question: str) -> list[float]:
    """Each chunk's BM25 score against `question` (English stopwords left out); all 0 when nothing matches."""
    (words,) = bm25s.tokenize([question], stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=False)
    if not words:
        return [0.0] * len(chunks)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([c.text for c in chunks], stopwords="en", stemmer=_STEMMER, show_progress=False), show_progress=False)
    return [float(score) for score in retriever.get_scores(words)]


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
