"""Text the user gives on the command line or stdin, checked before it reaches a tokenizer."""

from __future__ import annotations

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.tokenizer import lone_surrogate

SHOWN_CHARS = 40


def shown(value) -> str:
    """`value` as an error message quotes it: a text's repr, cut to its first characters."""
    if isinstance(value, str):
        return repr(value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS - 3] + "...")
    return repr(value) if isinstance(value, tuple) else str(value)


def checked_text(text: str, source: str) -> str:
    """`text` itself if it is valid UTF-8; otherwise E10001 naming `source` (`--prompt`, `stdin`). Bytes that
    are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    at = lone_surrogate(text)
    if at is not None:
        raise AtcError("E10001", shown(text), source, f"It is not valid UTF-8 text (byte "
                                                      f"{text[at].encode('utf-8', 'surrogateescape')!r} at character {at}).")
    return text
