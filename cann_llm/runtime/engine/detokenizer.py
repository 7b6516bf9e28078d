"""Incremental detokenization: text pieces as tokens arrive, never half a character, stop strings honoured."""

from __future__ import annotations

import bisect

from cann_llm.runtime.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    A token's text can depend on its neighbours (byte-level BPE splits characters across tokens, and
    some decoders drop a leading space at the start of a text), so each delta is the difference of two
    decodes over a short window, held back while it ends in an incomplete character. While the request
    runs, the last `len(longest stop) - 1` characters are held back too, so a stop string is never
    half-streamed.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.matched_stop: str | None = None
        # where each output token's text ends in `text` (before a stop string's cut): tokens read together,
        # or bytes of one character, end where the last of them does
        self.ends: list[int] = []

    def add(self, output_ids: list[int]) -> tuple[str, bool]:
        """Take the whole output so far; returns (new text to emit, whether a stop string ended it)."""
        prefix = self.tokenizer.decode(output_ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(output_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
            self.ends += [len(self.text)] * (len(output_ids) - len(self.ends))
        # the stop string that begins first in the text ends it, whichever the list names first (one token's
        # text can hold two)
        found = [(at, i) for i, stop in enumerate(self.stop)
                 if (at := self.text.find(stop, max(0, self.emitted - len(stop)))) >= 0]
        if found:
            at, first = min(found)
            self.text = self.text[:at]
            self.matched_stop = self.stop[first]
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self._holdback), False

    def tokens_within(self, characters: int) -> int:
        """How many output tokens make the first `characters` of the text: the fewest whose text reaches
        that far (a token a cut splits counts, with the tokens it ends together with; one whose text is not
        complete yet does not)."""
        count = bisect.bisect_right(self.ends, characters)
        if count < len(self.ends) and (self.ends[count - 1] if count else 0) < characters:
            count = bisect.bisect_right(self.ends, self.ends[count])
        return count

    def flush(self) -> str:
        """What was held back, once the request has finished."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece
