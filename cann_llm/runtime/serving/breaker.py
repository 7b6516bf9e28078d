"""A circuit breaker per engine: while an engine's steps keep failing, new requests are refused at once (503
with `Retry-After`) instead of queueing behind failures.

Closed, it counts failures in a row (requests that failed in a step: 500); `threshold` of them open it.
Open, it refuses everything for `cooldown_s`; then it lets one request through (half-open): that request
completing closes it, failing opens it again for another cool-down. A request that ends otherwise (the
client gone, a timeout) says nothing about the engine: the next one is let through instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class CircuitBreaker:
    """Not thread-safe: the server calls it under its admission lock."""

    threshold: int = 5
    cooldown_s: float = 10.0
    failures: int = 0                 # in a row
    opened_at: float | None = None
    probing: bool = False             # the half-open request is in flight

    def admit(self) -> float | None:
        """None when a request may go ahead, else the seconds until one may."""
        if self.opened_at is None:
            return None
        left = self.opened_at + self.cooldown_s - time.monotonic()
        if left > 0:
            return left
        if self.probing:
            return self.cooldown_s
        self.probing = True
        return None

    def record(self, outcome: str) -> None:
        """A request that was admitted has ended: `completed`, `failed` or `cancelled`."""
        if outcome == "completed":
            self.failures, self.opened_at = 0, None
        elif outcome == "failed":
            self.failures += 1
            if self.failures >= self.threshold or self.opened_at is not None:
                self.opened_at = time.monotonic()
        self.probing = False

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None
