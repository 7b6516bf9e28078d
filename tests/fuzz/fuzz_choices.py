"""Where a mutation's decisions come from: a seeded `random.Random` (benchmarks/fuzz.py, reproducible by
seed) or hypothesis' `data.draw` (the CI tier, derandomized). Mutators only ask a `Choices` for values, so
the same mutation code serves both, and each decision is logged so a failure names what was done."""

from __future__ import annotations

import random
from typing import Sequence, TypeVar

T = TypeVar("T")

# values that break arithmetic on sizes and indices: zero, negatives, 32- and 64-bit edges, huge
HOSTILE_INTS = (0, -1, 1, 2, 3, 5, 7, -(2**31), 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**53, 2**63 - 1, -(2**63), 2**40, 10**6)
HOSTILE_FLOATS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-308, 1e308, -1.0, 5e-324)
HOSTILE_STRINGS = ("", "\x00", "../../etc/passwd", "\ud800", "é" * 3, "x" * 4096, "NaN", "-1", "{}", "\u202e")


class Choices:
    """The decisions of one mutation, and a readable log of them (`.log`)."""

    def __init__(self):
        self.log: list[str] = []

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        raise NotImplementedError

    def choice(self, options: Sequence[T], label: str = "") -> T:
        """One of `options` (a non-empty sequence); noted in the log under `label` when given."""
        value = options[self.integer(0, len(options) - 1)]
        if label:
            self.note(f"{label}={value!r}"[:160])
        return value

    def chance(self, one_in: int) -> bool:
        """True once in `one_in` on average."""
        return self.integer(0, one_in - 1) == 0

    def note(self, text: str) -> None:
        """Record one step of the mutation."""
        self.log.append(text)

    def hostile_int(self, around: int | None = None) -> int:
        """An integer chosen to break size and index arithmetic, or a near neighbour of `around`."""
        if around is not None and self.chance(3):
            return around + self.choice((-1, 1, -around, around, around * 1000))
        return self.choice(HOSTILE_INTS)

    def hostile_float(self) -> float:
        return self.choice(HOSTILE_FLOATS)

    def hostile_string(self) -> str:
        return self.choice(HOSTILE_STRINGS)


class RandomChoices(Choices):
    """Decisions from `random.Random(seed)`: the seed reproduces the mutation."""

    def __init__(self, seed: int):
        super().__init__()
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)


class HypothesisChoices(Choices):
    """Decisions drawn from hypothesis' `st.data()`, so hypothesis explores (and can replay) them."""

    def __init__(self, data):
        super().__init__()
        from hypothesis import strategies as st

        self._data, self._st = data, st

    def integer(self, low: int, high: int) -> int:
        return self._data.draw(self._st.integers(low, high))
