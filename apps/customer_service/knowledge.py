"""The knowledge base: every `.md` and `.txt` file of a folder, ranked against a question by BM25 (bm25s)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import bm25s
import Stemmer

# bm25s sets its own logger to DEBUG, past whatever level the application chose
logging.getLogger("bm25s").setLevel(logging.WARNING)
# words matched by their stems ("refunds" finds "refund"), as bm25s recommends for English
_STEMMER = Stemmer.Stemmer("english")


@dataclass(frozen=True)
class Document:
    """One file: its name (the file's stem), title (its first Markdown heading, else the name) and text."""

    name: str
    title: str
    text: str


class KnowledgeBase:
    """`KnowledgeBase(folder)`; `search(question, k)` the best documents with their scores, best first."""

    def __init__(self, folder: str | Path):
        files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".md", ".txt") and p.is_file())
        if not files:
            raise ValueError(f"{folder} holds no .md or .txt files")
        self.documents = [_document(path) for path in files]
        self._index = bm25s.BM25()
        texts = [f"{d.title}\n{d.text}" for d in self.documents]
        self._index.index(bm25s.tokenize(texts, stopwords="en", stemmer=_STEMMER, show_progress=False),
                          show_progress=False)

    def search(self, question: str, k: int = 3) -> list[tuple[Document, float]]:
        """The `k` documents that score highest against `question` (those scoring 0 left out)."""
        (words,) = bm25s.tokenize([question], stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=False)
        if not words:
            return []
        scores = self._index.get_scores(words)
        ranked = sorted(range(len(self.documents)), key=lambda i: -scores[i])[:k]
        return [(self.documents[i], float(scores[i])) for i in ranked if scores[i] > 0]


def _document(path: Path) -> Document:
    text = path.read_text(encoding="utf-8")
    heading = next((line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")), None)
    return Document(path.stem, heading or path.stem, text)
