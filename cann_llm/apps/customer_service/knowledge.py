"""The knowledge base: every `.md` and `.txt` file of a folder, ranked against a question by BM25 (bm25s),
each match also telling how much of the question the document covers, which says whether it is relevant
however few documents there are."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import bm25s
import Stemmer

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import read_text

# bm25s sets its own logger to DEBUG, past whatever level the application chose
logging.getLogger("bm25s").setLevel(logging.WARNING)
# words matched by their stems ("refunds" finds "refund"), as bm25s recommends for English
_STEMMER = Stemmer.Stemmer("english")
# NLTK's English stopwords: bm25s's shorter default keeps "how", "do", "can", "my", which every question
# has and which would count as the question's words in `Match.coverage`
_STOPWORDS = "en_plus"


@dataclass(frozen=True)
class Document:
    """One file: its name (the file's stem), title (its first Markdown heading, else the name) and text."""

    name: str
    title: str
    text: str


class Match(NamedTuple):
    """A document found for a question: its BM25 score, which ranks the documents, and its coverage, the
    share of the question's words (stems, stopwords left out) it contains. BM25's scores shrink with the
    number of documents (a word in every one of them weighs almost nothing), so only the coverage can be
    held to a threshold that means the same for one document as for a thousand."""

    document: Document
    score: float
    coverage: float


class KnowledgeBase:
    """`KnowledgeBase(folder)`; `search(question, k)` the best documents, best first. E10001 for a folder
    without .md or .txt files, E13001 for a file that cannot be read as UTF-8 text."""

    def __init__(self, folder: str | Path):
        try:
            files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".md", ".txt") and p.is_file())
        except OSError as error:
            raise AtcError("E13001", folder, error.strerror or str(error)) from None
        if not files:
            raise AtcError("E10001", folder, "--knowledge", "the folder holds no .md or .txt files")
        self.documents = [_document(path) for path in files]
        tokens = bm25s.tokenize([f"{d.title}\n{d.text}" for d in self.documents], stopwords=_STOPWORDS,
                                stemmer=_STEMMER, show_progress=False)
        if not tokens.vocab:  # empty files, or only stopwords: nothing a question could match
            raise AtcError("E10001", folder, "--knowledge", "the folder's documents hold no words to search")
        stems = {index: stem for stem, index in tokens.vocab.items()}
        self._stems = [{stems[index] for index in ids} for ids in tokens.ids]
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)

    def search(self, question: str, k: int = 3) -> list[Match]:
        """The `k` documents that score highest against `question` (those sharing no word with it left out)."""
        (words,) = bm25s.tokenize([question], stopwords=_STOPWORDS, stemmer=_STEMMER, return_ids=False,
                                  show_progress=False)
        if not words:
            return []
        scores = self._index.get_scores(words)
        ranked = sorted(range(len(self.documents)), key=lambda i: -scores[i])[:k]
        asked = set(words)
        return [Match(self.documents[i], float(scores[i]), len(asked & self._stems[i]) / len(asked))
                for i in ranked if scores[i] > 0]


def _document(path: Path) -> Document:
    text = read_text(path)
    heading = next((line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")), None)
    return Document(path.stem, heading or path.stem, text)
