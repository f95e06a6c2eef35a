"""When a model service may run a step on its event loop instead of its worker thread."""

from __future__ import annotations


class InlineSteps:
    """Whether a step may run on the event loop itself instead of the worker thread.

    Handing a step to the worker and its answer back costs about 0.25 ms of thread wake-ups and
    GIL hand-overs (bench/hop.py's profile), which for a small model is a good part of a round.
    A step runs inline only when (1) the worker is idle (every job submitted before has finished
    and been collected on this loop), so runtime work keeps its submission order and never runs
    on two threads at once, and (2) the recent steps were short (an exponential average below
    ``max_ms``), so the loop never stalls longer than that for health checks or other streams.
    ``max_ms=0`` turns it off (a GPU service: its CUDA state belongs to the worker thread)."""

    def __init__(self, max_ms: float = 2.0) -> None:
        self.max_s = max_ms / 1000
        self.avg_s: float | None = None  # unknown until a step ran: the first goes to the worker
        self.num_submitted = 0  # jobs on the worker not yet collected

    def allow(self) -> bool:
        return self.num_submitted == 0 and self.avg_s is not None and self.avg_s < self.max_s

    def observe(self, seconds: float) -> None:
        self.avg_s = seconds if self.avg_s is None else 0.8 * self.avg_s + 0.2 * seconds
