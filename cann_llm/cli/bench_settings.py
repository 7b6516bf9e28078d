"""`BenchSettings`: `cann-run bench`'s own flags, parsed and checked before the model loads, so that a typo
costs no run."""

from __future__ import annotations

import os
from dataclasses import dataclass

from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.safe_files import read_text


@dataclass(frozen=True)
class BenchSettings:
    """What one bench run measures; `from_flags` refuses a bad flag with E10001 naming it (E13001 for a
    file that cannot be read)."""

    onnx: str | None
    text_file: str
    text: str
    requests: int
    concurrency: tuple[int, ...]
    prompt_lengths: tuple[int, int]
    output_lengths: tuple[int, int]
    prefill_tokens: int
    decode_tokens: int
    repeats: int
    long_prefill: tuple[int, ...]
    seed: int

    @classmethod
    def from_flags(cls, *, onnx: str | None, text_file: str, requests: int, concurrency: str, prompt_lengths: str,
                   output_lengths: str, prefill_tokens: int, decode_tokens: int, repeats: int, long_prefill: str,
                   seed: int) -> "BenchSettings":
        """The flags as click gives them (comma lists as text) → settings; AtcError for any that is bad."""
        levels = _positive_ints(concurrency, "concurrency")
        if not levels:
            raise invalid_value(repr(concurrency), "concurrency", "Give one or more client counts, e.g. 1,8,32.")
        if onnx is not None and not os.path.isfile(onnx):
            raise AtcError("E13001", onnx, "Is a directory" if os.path.isdir(onnx) else "No such file or directory")
        text = read_text(text_file)
        if not text.strip():
            raise invalid_value(text_file, "text", "The file holds no text to take prompts from.")
        return cls(onnx=onnx, text_file=text_file, text=text, requests=requests, concurrency=tuple(levels),
                   prompt_lengths=_range(prompt_lengths, "prompt_lengths"),
                   output_lengths=_range(output_lengths, "output_lengths"), prefill_tokens=prefill_tokens,
                   decode_tokens=decode_tokens, repeats=repeats,
                   long_prefill=tuple(_positive_ints(long_prefill, "long_prefill")), seed=seed)

    def prompt_sizes(self) -> dict[str, int]:
        """The longest prompt each flag makes the bench send, by flag."""
        sizes = {"prefill_tokens": self.prefill_tokens, "prompt_lengths": self.prompt_lengths[1]}
        if self.long_prefill:
            sizes["long_prefill"] = max(self.long_prefill)
        return sizes

    def check_fits(self, max_context_len: int) -> None:
        """E10001 naming the flag whose prompts the loaded model cannot take (a prompt of N tokens needs
        N + 1 of the context), before anything is measured."""
        for flag, tokens in self.prompt_sizes().items():
            if tokens + 1 > max_context_len:
                raise invalid_value(tokens, flag, f"A prompt of {tokens} tokens does not fit the model's context of "
                                                  f"{max_context_len} tokens; give at most "
                                                  f"{max_context_len - 1}" + (", or '' to skip long prefills."
                                                                             if flag == "long_prefill" else "."))


def _positive_ints(text: str, flag: str) -> list[int]:
    """`"1,8,32"` → [1, 8, 32]; `""` → []."""
    if not text.strip():
        return []
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise invalid_value(repr(text), flag, f"{part.strip()!r} is not an integer: give comma-separated "
                                                  "positive integers.") from None
        if value < 1:
            raise invalid_value(repr(text), flag, f"{value} is not a positive integer.")
        values.append(value)
    return values


def _range(text: str, flag: str) -> tuple[int, int]:
    """`"32,512"` → (32, 512): two positive integers, the first no larger than the second."""
    values = _positive_ints(text, flag)
    if len(values) != 2 or values[0] > values[1]:
        raise invalid_value(repr(text), flag, "Give MIN,MAX: two positive integers, MIN <= MAX.")
    return values[0], values[1]
