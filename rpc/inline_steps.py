"""When a model service may run a step on its event loop instead of its worker thread."""

from __future__ import annotations

import argparse

# On CPU a hand-off to the worker and back costs about 0.2 ms (0.08 in, 0.13 out on the hop's
# tiny pair, `bench.round_timeline --cluster`'s cut of a call): 2 % or more of any step under
# this, which is also as long as the loop may stall between reads.
DEFAULT_CPU_MS = 10.0


class InlineSteps:
    """Whether a step may run on the event loop itself instead of the worker thread.

    Handing a step to the worker and its answer back costs about 0.2 ms of thread wake-ups and
    GIL hand-overs (`DEFAULT_CPU_MS`), which for a small model is a good part of a round.
    A step runs inline only when (1) the worker is idle (every job submitted before has finished
    and been collected on this loop), so runtime work keeps its submission order and never runs
    on two threads at once, and (2) the recent steps were short (an exponential average below
    ``max_ms``), so the loop never stalls longer than that for health checks or other streams.
    ``max_ms=0`` turns it off (the default on a GPU: `for_device`)."""

    def __init__(self, max_ms: float = DEFAULT_CPU_MS) -> None:
        self.max_s = max_ms / 1000
        self.avg_s: float | None = None  # unknown until a step ran: the first goes to the worker
        self.num_submitted = 0  # jobs on the worker not yet collected

    def allow(self) -> bool:
        return self.num_submitted == 0 and self.avg_s is not None and self.avg_s < self.max_s

    def observe(self, seconds: float) -> None:
        self.avg_s = seconds if self.avg_s is None else 0.8 * self.avg_s + 0.2 * seconds


def for_device(device: str, max_ms: float | None) -> InlineSteps:
    """The service's policy: ``max_ms`` when given (``--inline-step-ms``), else 10 ms on CPU and
    off on a GPU, whose steps then keep to the worker thread (they wait on the device, and the
    hand-off on a GPU is not yet measured against them). Inline steps on a GPU run on the
    calling thread, the event loop's: the service's device is made current there."""
    if max_ms is None:
        max_ms = DEFAULT_CPU_MS if device == "cpu" else 0.0
    if max_ms > 0 and device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device).index or 0)
    return InlineSteps(max_ms)


def add_inline_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--inline-step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="run a step on the service's event loop, not its worker thread (no thread hand-off "
        "each way), while recent steps averaged under MS and no other work is queued; default "
        f"{DEFAULT_CPU_MS:g} on CPU, 0 (off) on a GPU",
    )
