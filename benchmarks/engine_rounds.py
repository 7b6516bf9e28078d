"""Batch-1 decode timed on several engines in turn, round after round, so a shared machine's noise falls on
all of them alike (benchmarks/decode_ab.py, benchmarks/huge_pages_ab.py)."""

from __future__ import annotations

import statistics
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


def report(times: dict, tokens: dict, labels: dict, faster: object, slower: object) -> str:
    """Each engine's median milliseconds a token and its rounds, the ratio `slower` over `faster` by round
    with its median (above 1: `faster` is), and whether the two decoded the same tokens."""
    lines = [f"{labels[name]}: {statistics.median(values):.3f} ms a token   " + " ".join(f"{v:.2f}" for v in values)
             for name, values in times.items()]
    ratios = [b / a for a, b in zip(times[faster], times[slower])]
    lines.append(f"{labels[slower]} / {labels[faster]}: {statistics.median(ratios):.3f}x   by round "
                 + " ".join(f"{r:.2f}" for r in ratios))
    lines.append(f"the same tokens: {tokens[faster] == tokens[slower]}")
    return "\n".join(lines)
