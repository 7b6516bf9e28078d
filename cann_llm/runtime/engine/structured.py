"""Structured outputs: a request's tokens kept inside a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (docs/serving.md#structured-outputs says why): the model's tokenizer is
wrapped once per engine, each constrained sequence gets a matcher, and before every sampled token the
matcher gives the set of tokens that keep the output inside the grammar, as a bitmask over the vocabulary.
Masks of a whole batch are computed together, in llguidance's own threads and without the GIL, while the
model runs the step (`MaskBatch`).
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from cann_llm.runtime.engine.setting_error import SettingError

MAX_CHOICES, MAX_GRAMMAR_CHARS = 1024, 1 << 20
# JSON written as json.dumps writes it: with whitespace allowed anywhere, small models fill arrays with
# newlines until max_tokens (seen on SmolLM2). A schema's own "x-guidance" options override these
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of `json` (a JSON schema, as a dict or its text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings) or `grammar` (Lark, as
    llguidance reads it). vLLM's `StructuredOutputsParams` has the same fields."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SettingError("structured_output",
                               "a structured output takes exactly one of json, json_object, regex, choice or grammar"
                               + (f", not {' and '.join(given)}" if given else ""))
        if self.choice is not None and not (0 < len(self.choice) <= MAX_CHOICES and all(
                isinstance(c, str) and c for c in self.choice)):
            raise SettingError("structured_output", f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        text = self.grammar or self.regex or ""
        if len(text) > MAX_GRAMMAR_CHARS:
            raise SettingError("structured_output", f"the grammar has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")

    def __hash__(self) -> int:
        # a schema given as a dict hashes by its keys, which equal dicts share (its values may be unhashable,
        # and equal values may print apart: 1 and 1.0): SamplingParams holding one are a frozen value like
        # any other (a dict key, a set member)
        schema = frozenset(self.json) if isinstance(self.json, dict) else self.json
        return hash((schema, self.json_object, self.regex, self.choice, self.grammar))

    def llguidance_grammar(self) -> str:
        """This constraint as a grammar llguidance compiles."""
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise SettingError("structured_output", f"the JSON schema is not JSON: {error}") from None
            if not isinstance(schema, dict):
                raise SettingError("structured_output", "the JSON schema must be an object")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            except Exception as error:  # llguidance's compiler raises on a schema it cannot take
                raise SettingError("structured_output", f"the JSON schema cannot be used: {error}") from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON's string escapes are Lark's
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, built on first use (~0.1 s for a 49K vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids):
        self._source, self.vocab_size, self._eos = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        # one engine's steps come one at a time: one thread hands each step's masks to llguidance
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llguidance-masks")

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now, not at the first structured request."""
        if self._tokenizer is None:
            # a tokenizer without an end-of-sequence token: llguidance picks its own stand-in
            self._tokenizer = llguidance.LLTokenizer(self._source, n_vocab=self.vocab_size, eos_token=self._eos or None)

    def constraint(self, spec: StructuredOutput) -> "Constraint":
        """A fresh matcher for `spec`; ValueError naming what is wrong with a grammar that does not compile."""
        self.prepare()
        grammar = spec.llguidance_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise SettingError("structured_output", f"the structured output cannot be compiled: {error.strip()}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SettingError("structured_output", f"the structured output cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)

    def masks(self, constraints: list["Constraint"]) -> "MaskBatch":
        """The next tokens' masks of `constraints`, started now in the background."""
        return MaskBatch(constraints, self._pool)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Constraint:
    """One sequence's matcher: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, as booleans over the vocabulary (computed now)."""
        bits = np.empty((1, (self.vocab_size + 31) // 32), np.int32)
        fill_next_token_bitmask(self.matcher, bits)
        return unpack(bits[0], self.vocab_size)

    def accept(self, token: int) -> None:
        """Take a sampled token (one the mask allowed, so the matcher cannot refuse it)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the structured output: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a draft) the grammar allows from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    @property
    def done(self) -> bool:
        """The output is complete: nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()


def unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask row (32 tokens an int32, lowest bit first) as booleans over the vocabulary."""
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


class MaskBatch:
    """Masks for several constraints, computed in the background on `pool` (llguidance's threads, the GIL
    released) while the model runs the step; `result(i)` waits for row i."""

    _executor = llguidance.LLExecutor()

    def __init__(self, constraints: list[Constraint], pool: ThreadPoolExecutor):
        self.vocab_size = constraints[0].vocab_size
        self.bits = np.empty((len(constraints), (self.vocab_size + 31) // 32), np.int32)
        pairs = [(c.matcher, i) for i, c in enumerate(constraints)]
        self._future: Future = pool.submit(fill_next_token_bitmask_par, self._executor, pairs, self.bits)

    def result(self, index: int) -> np.ndarray:
        self._future.result()
        return unpack(self.bits[index], self.vocab_size)
