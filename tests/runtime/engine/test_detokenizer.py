"""Incremental detokenization with a real byte-level tokenizer (characters split across tokens)."""

from __future__ import annotations

import pytest

from cann_llm.models.tiny import byte_tokenizer_json
from cann_llm.runtime.engine.detokenizer import IncrementalDetokenizer
from cann_llm.runtime.tokenizer import TextTokenizer

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


def test_the_tokens_of_a_text_cut_by_a_stop_string_are_those_it_was_made_of():
    """A stop string's tokens are not the text's (their log-probabilities are left out), and every byte of a
    character the text kept is: "日本" is six byte tokens, and the cut falls after them."""
    tokenizer = _tokenizer()
    ids = tokenizer.encode("a日本STOP語")
    detok = IncrementalDetokenizer(tokenizer, ("STOP",))
    for n in range(1, len(ids) + 1):
        _, stopped = detok.add(ids[:n])
        if stopped:
            break
    assert detok.text == "a日本" and detok.tokens_within(len(detok.text)) == len(tokenizer.encode("a日本")) == 7
    assert detok.tokens_within(2) == 4 and detok.tokens_within(1) == 1 and detok.tokens_within(0) == 0


def test_a_tokens_bytes_are_what_it_stands_for_not_its_replacement_character():
    tokenizer = _tokenizer()  # byte-level: one token a byte, most of TEXT's characters split across tokens
    ids = tokenizer.encode(TEXT)
    assert "\ufffd" in {tokenizer.token_text(i) for i in ids}
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == TEXT.encode("utf-8")


def _sentencepiece() -> TextTokenizer:
    """Llama's layout: `▁` for a space, a character outside the vocabulary as `<0xNN>` tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257, "h": 258, "i": 259}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return TextTokenizer({"tokenizer.json": spm.to_str()})


def test_sentencepiece_byte_fallback_tokens_are_their_byte():
    tokenizer = _sentencepiece()
    ids = tokenizer.encode("hi 🙂 hé")
    assert sum(tokenizer.token_text(i).startswith("<0x") or tokenizer.token_text(i) == "\ufffd" for i in ids) >= 5
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " hi 🙂 hé".encode("utf-8")


def test_pieces_are_the_whole_decode_under_a_chat_models_tokenizer():
    """SmolLM2's byte-level BPE (the embedded default model's), its special tokens among the ids: the pieces,
    token by token, add up to decoding the whole output with special tokens dropped."""
    from cann_llm.models.prepare import smollm2_hf_folder

    tokenizer = TextTokenizer({"tokenizer.json": (smollm2_hf_folder() / "tokenizer.json").read_text(encoding="utf-8")})
    ids = tokenizer.encode("<|im_start|>assistant\nnaïve café — 日本語, 🙂 and  two spaces.<|im_end|>\n Next line")
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[:n])[0] for n in range(1, len(ids) + 1)] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_bytes_that_never_make_a_character_are_streamed_as_replacement_characters():
    """A sampled run of byte-fallback tokens need not be valid UTF-8 (`<0xE2><0x80>` then a space): the
    stream goes on, each byte that makes no character a replacement character. The newline before them was
    a whole character when it came and stays streamed, where decoding the whole output at once replaces it
    too (tokenizers' own DecodeStream raises here instead)."""
    tokenizer = _sentencepiece()
    h, i = tokenizer.encode("hi")[-2:]
    ids = [h, i, 1 + 0x0A, 1 + 0xE2, 1 + 0x80, 257, h]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[:n])[0] for n in range(1, len(ids) + 1)] + [detok.flush()]
    assert "".join(pieces) == "hi\n\ufffd\ufffd h"


def test_the_stop_string_first_in_the_text_wins_whichever_is_listed_first():
    """Both stop strings arrive in one token's text here: the cut is at the earlier of them."""
    tokenizer = _tokenizer()
    ids = tokenizer.encode("The capital is Paris.")
    for stop in (("Pa", "ris"), ("ris", "Pa")):
        detok = IncrementalDetokenizer(tokenizer, stop)
        piece, stopped = detok.add(ids)  # the whole text at once, as one token's may be
        assert stopped and (piece, detok.matched_stop) == ("The capital is ", "Pa")
