"""The circuit breaker the router keeps per replica."""

from __future__ import annotations

import time


class CircuitBreaker:
    """Closed: the draft is used. A failure opens it for ``cooldown_s``; afterwards one attempt is
    let through (half-open) and a success closes it again."""

    def __init__(self, cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self.open_until = 0.0
        self.failures = 0

    def allows(self) -> bool:
        return time.monotonic() >= self.open_until

    def record_failure(self) -> None:
        self.failures += 1
        self.open_until = time.monotonic() + self.cooldown_s

    def record_success(self) -> None:
        self.failures = 0
        self.open_until = 0.0
