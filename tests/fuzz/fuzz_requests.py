"""Hypothesis strategies for hostile requests to the OpenAI-compatible API: bodies shaped like OpenAI's
(most fields plausible so the request reaches generation, some wrong in type or range: NaN, huge, negative,
lone surrogates, huge stop lists, token ids outside the vocabulary), and raw bodies that are not JSON at all.
`request()` draws (path, body bytes, stream?)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

VOCAB = 256
NUMBERS = (float("nan"), float("inf"), float("-inf"), -1, 0, 1e-308, 1e308, 2**31, 2**63, -(2**63), 2**64, 10**30, 0.5, 2)
TEXTS = ("", "hi", "\ud800", "a\udfffb", "x" * 20_000, "\x00", "😀", "Hello, world", "[assistant]")

numbers = st.one_of(st.sampled_from(NUMBERS), st.integers(), st.floats())
texts = st.one_of(st.sampled_from(TEXTS), st.text(max_size=40))
junk = st.one_of(st.none(), st.booleans(), numbers, texts, st.lists(st.integers(-5, 300), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from((-1, VOCAB, 2**31, -(2**63), 2**63 - 1, 10**20))),
                     max_size=40)
stops = st.one_of(texts, st.lists(texts, max_size=8), st.just(["a"] * 5000), st.just(["x" * 10_000]), junk)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(("user", "system", "assistant", "tool", "")), "content": texts},
                                   optional={"name": texts}), min_size=1, max_size=4),
    st.just([]), st.just([{"role": "user"}]), junk)


def _mostly(good, bad):
    """`good` three times in four."""
    return st.one_of(good, good, good, bad)


SAMPLING = {
    "model": _mostly(st.just("tiny"), st.one_of(st.just("nope"), junk)),
    "temperature": _mostly(st.sampled_from((0, 0.7, 1.0)), st.one_of(numbers, junk)),
    "top_p": _mostly(st.sampled_from((1.0, 0.9)), st.one_of(numbers, junk)),
    "top_k": _mostly(st.sampled_from((0, 5)), st.one_of(numbers, junk)),
    "seed": _mostly(st.integers(0, 2**31), st.one_of(numbers, junk)),
    "stop": stops,
    "stream": _mostly(st.booleans(), junk),
    "repetition_penalty": _mostly(st.sampled_from((1.0, 1.2)), st.one_of(numbers, junk)),
    "ignore_eos": st.one_of(st.booleans(), junk),
}
MAX_TOKENS = _mostly(st.integers(1, 12), st.one_of(numbers, junk))

BODIES = {
    "/v1/completions": st.fixed_dictionaries({"prompt": _mostly(st.one_of(texts, token_ids), junk)},
                                             optional={**SAMPLING, "max_tokens": MAX_TOKENS}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": _mostly(messages, junk)},
                                                  optional={**SAMPLING, "max_tokens": MAX_TOKENS,
                                                            "max_completion_tokens": MAX_TOKENS}),
    "/generate": st.fixed_dictionaries({"prompt": _mostly(texts, junk)},
                                       optional={"max_length": MAX_TOKENS, "temperature": SAMPLING["temperature"],
                                                 "model": SAMPLING["model"]}),
}
RAW_BODIES = (b"", b"{", b"[]", b"null", b'{"prompt": NaN, "max_tokens": Infinity}', b"\xff\xfe\x00", b'"x"',
              b'{"prompt": "' + b"\xed\xa0\x80" + b'"}', b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
              b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + json.dumps(["s"] * 100_000).encode() + b"}")


@st.composite
def request(draw) -> tuple[str, bytes, bool]:
    """(path, body bytes, whether to read it as a stream)."""
    path = draw(st.sampled_from(sorted(BODIES)))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.sampled_from(RAW_BODIES)), False
    body = draw(BODIES[path])
    # NaN and Infinity as Python writes them, lone surrogates as \\ud800 escapes: both as a hostile client sends
    return path, json.dumps(body, allow_nan=True).encode(), body.get("stream") is True
