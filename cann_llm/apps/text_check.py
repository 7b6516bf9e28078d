"""The text a user gives the applications, checked the same way on the command line and over HTTP."""

from __future__ import annotations

from cann_llm.runtime.tokenizer import lone_surrogate


def unusable(text: str) -> str | None:
    """Why `text` cannot be asked of the model, or None when it can: it is blank, or it holds a lone
    surrogate (JSON's "\\ud800", or a command-line argument that is not UTF-8), which no tokenizer takes."""
    if not text.strip():
        return "it is empty"
    at = lone_surrogate(text)
    return None if at is None else f"it is not valid UTF-8 (a lone surrogate at character {at})"
