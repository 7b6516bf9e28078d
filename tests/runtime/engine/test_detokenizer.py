"""Incremental detokenization with a real byte-level tokenizer (characters split across tokens)."""

from __future__ import annotations

import pytest

from models.tiny import byte_tokenizer_json
from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.tokenizer import TextTokenizer

pytestmark = pytest.mark.unit

TEXT = "naïve café, 日本語 and emoji 🙂 end"


def _tokenizer() -> TextTokenizer:
    return TextTokenizer({"tokenizer.json": byte_tokenizer_json()})


def _stream(text: str, stop=()):
    tokenizer = _tokenizer()
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tuple(stop))
    pieces, stopped = [], False
    for n in range(1, len(ids) + 1):
        piece, stopped = detok.add(ids[:n])
        pieces.append(piece)
        if stopped:
            break
    pieces.append(detok.flush())
    return pieces, stopped, len(ids)


def test_pieces_add_up_to_the_text_and_never_hold_half_a_character():
    pieces, stopped, count = _stream(TEXT)
    assert count > len(TEXT)  # multi-byte characters really are split across tokens
    assert "".join(pieces) == TEXT and not stopped
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_ends_the_text_and_is_never_half_streamed():
    pieces, stopped, _ = _stream("alpha beta STOP gamma", stop=["STOP"])
    assert stopped and "".join(pieces) == "alpha beta "
    assert not any("S" in piece for piece in pieces)
