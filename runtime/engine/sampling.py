"""`SamplingParams`: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

# beyond these a penalty or a temperature scales float32 logits past their range (inf - inf is NaN)
PENALTY_RANGE = (1e-2, 1e2)
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; `temperature=0` is greedy. Checked on construction (ValueError):
    numbers finite and in range."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "repetition_penalty": self.repetition_penalty}
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, not {value!r}")
        low, high = PENALTY_RANGE
        checks = (
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
             f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (off) or positive"),
            (low <= self.repetition_penalty <= high, f"repetition_penalty must be in [{low:g}, {high:g}]"),
            (self.seed is None or 0 <= self.seed < 2 ** 64, "seed must be in [0, 2**64)"),
            (all(self.stop), "stop strings must not be empty"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
