"""Text the user gives on the command line or stdin, checked before it reaches a tokenizer."""

from __future__ import annotations

from runtime.errors import AtcError

SHOWN_CHARS = 40


def shown(value) -> str:
    """`value` as an error message quotes it: a text's repr, cut to its first characters."""
    if isinstance(value, str):
        return repr(value if len(value) <= SHOWN_CHARS else value[:SHOWN_CHARS - 3] + "...")
    return repr(value) if isinstance(value, tuple) else str(value)


def checked_text(text: str, source: str) -> str:
    """`text` itself if it is valid UTF-8; otherwise E10001 naming `source` (`--prompt`, `stdin`). Bytes that
    are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise AtcError("E10001", shown(text), source,
                       f"It is not valid UTF-8 text (byte {error.object[error.start].encode('utf-8', 'surrogateescape')!r} "
                       f"at character {error.start}).") from None
    return text
