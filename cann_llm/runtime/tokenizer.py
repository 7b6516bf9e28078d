"""The model's tokenizer, read from the artifact's tokenizer partition (Hugging Face `tokenizers`)."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer, decoders

from cann_llm.runtime.errors import AtcError


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate, which no tokenizer takes (bytes that are not UTF-8 reach Python so,
    from a command line or a file read with surrogateescape; JSON can spell one), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


class TextTokenizer:
    """Encode and decode with the tokenizer the model was compiled with."""

    def __init__(self, files: dict[str, str]):
        if "tokenizer.json" not in files:
            raise AtcError("E10001", "tokenizer", "--model",
                           "The model was compiled without a tokenizer; recompile with atc --tokenizer=DIR.")
        self._tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        self._max_token_chars: int | None = None
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_token = _content(config.get("bos_token"))
        self.eos_token_ids = self._eos_ids(config, json.loads(files.get("generation_config.json", "{}")))

    def _eos_ids(self, config: dict, generation: dict) -> frozenset[int]:
        """End-of-sequence ids: generation_config's list when there is one, else the tokenizer's eos_token."""
        eos = generation.get("eos_token_id")
        if eos is None:
            token = _content(config.get("eos_token"))
            eos = self._tokenizer.token_to_id(token) if token else None
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS when the tokenizer's config asks for it (and special tokens are on)."""
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos = self._tokenizer.token_to_id(self.bos_token) if isinstance(self.bos_token, str) else None
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no special tokens) and each token's (start, end) characters in it."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest string in the vocabulary: a text has at least len(text) / this tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tokenizer.get_vocab()), default=1)
        return self._max_token_chars

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, keeping leading spaces visible to a reader."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_chars(self, token_id: int) -> int:
        """Characters one token adds to decoded text: none for a special token, which `decode` drops."""
        return len(self._tokenizer.decode([token_id], skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a token holding part of a character (a byte-level piece, a
        `<0xE2>` byte-fallback token) is its bytes, where its text would show a replacement character."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        fallback = _BYTE_TOKEN.fullmatch(piece)
        if fallback:
            return bytes([int(fallback[1], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece spells a space as U+2581


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves, the rest are
    shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


_BYTE_OF = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _content(token) -> str | None:
    """A special token as text: tokenizer configs spell it as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token
