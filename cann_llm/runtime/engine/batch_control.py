"""The running batch's size adapted to a step-time target: more sequences a step raise throughput and
lengthen every sequence's time between tokens. With `EngineConfig.max_step_latency_ms`, the engine caps
how many sequences run at once, additive increase and multiplicative decrease (as TCP's congestion
window): a decode step over the target cuts the cap by a quarter, one under 80% of it while the cap is
full lets one more in. Steps that carry prompt tokens are left out: a prefill chunk is long by nature.
Running sequences over a lowered cap are not preempted; new ones wait until the batch is under it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchSizeController:
    """`cap` between 1 and `most`, moved by `observe` after each step."""

    target_s: float
    most: int
    cap: int = 0

    def __post_init__(self) -> None:
        self.cap = self.cap or self.most

    def observe(self, step_s: float, running: int, decode_only: bool) -> int:
        """Take one step's time (with `running` sequences); returns the new cap."""
        if not decode_only:
            return self.cap
        if step_s > self.target_s:
            self.cap = max(1, min(self.cap, running) * 3 // 4)
        elif step_s < 0.8 * self.target_s and running >= self.cap:
            self.cap = min(self.most, self.cap + 1)
        return self.cap
