"""The periodic stats line of a serving process: per engine, sequences running and waiting, generation
tokens/s since the last look, KV pages used of the pool; a line only for an engine whose state changed."""

from __future__ import annotations

import time
from typing import Callable

from cann_llm.runtime.engine.engine import LLMEngine


class StatsLines:
    """`StatsLines(engines).lines()` at every interval: a line for each engine that changed since the last."""

    def __init__(self, engines: dict[str, LLMEngine], clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._names: dict[int, list[str]] = {}
        self._engines: dict[int, LLMEngine] = {}
        for name, engine in engines.items():  # the same engine under two names is one line
            self._names.setdefault(id(engine), []).append(name)
            self._engines[id(engine)] = engine
        now = clock()
        self._last = {ident: (now, self._state(engine)) for ident, engine in self._engines.items()}

    def lines(self) -> list[str]:
        """What changed since the last call (nothing when idle)."""
        now, lines = self._clock(), []
        for ident, engine in self._engines.items():
            then, before = self._last[ident]
            state = self._state(engine)
            self._last[ident] = (now, state)
            if state == before:
                continue
            running, waiting, generated, used = state
            rate = (generated - before[2]) / max(now - then, 1e-9)
            lines.append(f"{', '.join(self._names[ident])}: {running} running, {waiting} waiting, "
                         f"{rate:.1f} tokens/s, KV pages {used}/{engine.blocks.num_pages}")
        return lines

    @staticmethod
    def _state(engine: LLMEngine) -> tuple[int, int, int, int]:
        # read from another thread than the engine's: each count is one read, good enough for a log line
        return (len(engine.scheduler.running), len(engine.scheduler.waiting), engine.stats.generated_tokens,
                engine.blocks.num_used)
