"""What the router keeps per replica to handle faults: a circuit breaker and a step deadline."""

from __future__ import annotations

import time
from collections import deque


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


class StepDeadline:
    """How long to wait for a replica's step: ``factor`` times the p99 of its last ``window``
    steady step latencies, at least ``floor_s`` and at most ``max_s`` (``max_s`` until
    ``min_samples`` steps were seen). A hung draft then costs a few normal rounds, not ``max_s``.
    A step over more rows than the steady steps carried (a burst of prompts to extend over, a
    larger batch) gets that deadline scaled by how many more (`seconds_for`): more work is not a
    hang."""

    def __init__(
        self,
        max_s: float,
        floor_s: float = 0.5,
        factor: float = 4.0,
        window: int = 128,
        min_samples: int = 16,
    ) -> None:
        self.max_s, self.floor_s, self.factor, self.min_samples = (
            max_s,
            floor_s,
            factor,
            min_samples,
        )
        self.latencies: deque[float] = deque(maxlen=window)
        self.rows: deque[int] = deque(maxlen=window)

    def observe(self, seconds: float, rows: int = 1) -> None:
        """Record a steady step over ``rows`` rows that answered in time (a timed-out step is not
        a latency)."""
        self.latencies.append(seconds)
        self.rows.append(max(1, rows))

    @property
    def seconds(self) -> float:
        """The deadline of a steady step."""
        return self.seconds_for(0)

    def seconds_for(self, rows: int) -> float:
        """The deadline of a step over ``rows`` rows: the steady one, times how many more rows
        it carries than the median steady step, at most ``max_s``."""
        if len(self.latencies) < self.min_samples:
            return self.max_s
        ordered = sorted(self.latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        typical = sorted(self.rows)[len(self.rows) // 2]
        steady = max(self.floor_s, self.factor * p99)
        return min(self.max_s, steady * max(1.0, rows / typical))
