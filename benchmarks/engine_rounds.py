"""Batch-1 decode timed on several engines in turn, round after round, so a shared machine's noise falls on
all of them alike (benchmarks/decode_ab.py, benchmarks/huge_pages_ab.py)."""

from __future__ import annotations

import time


def decode_rounds(engines: dict, prompt: list[int], steps: int, rounds: int) -> tuple[dict, dict]:
    """({name: ms a token of each round}, {name: the tokens of its last round}): each engine decodes `steps`
    tokens greedily after `prompt` once a round, in turn, the order reversed every other round (with the same
    library in both, the engine that always ran second was 1.7% faster, SmolLM2 FP32, 2026-12-04); the engines
    are closed after."""
    times: dict = {name: [] for name in engines}
    tokens: dict = {}
    try:
        for round_ in range(rounds):
            order = list(engines.items())
            for name, engine in order[::-1] if round_ % 2 else order:
                start = time.perf_counter()
                tokens[name] = engine.generate(prompt, max_new_tokens=steps, temperature=0.0, ignore_eos=True)
                times[name].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        for engine in engines.values():
            engine.close()
    return times, tokens
