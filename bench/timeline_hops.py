"""A router's call to a service, cut where it changes hands (`bench.round_timeline --cluster`).

Every process stamps its spans on the same monotonic clock, so one call's time splits exactly
into consecutive segments, each ending where the next begins:

    before the write     the router builds the batch's messages    call start -> write start
    to the service       serialize, the wire, the service's read   -> the batch is whole there
    queued               the service's event loop before the step  -> service.step starts
    hand-off in          the step's way to the worker thread       -> <service>.rpc_batch starts
    the service's batch  decode, run, encode (`<service>.rpc_batch`)
    hand-off out         the answer's way back to the event loop   -> service.step ends
    back to the router   write, the wire, the router's read        -> the answer is whole there
    after the answer     the router decodes it                     -> the call ends

A step run on the event loop (`rpc.inline_steps`) has no hand-off: both are a few
microseconds. The segments' means add up to the call's mean. Calls whose spans are not all
there (a release in between, a failed batch) are left out.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specmesh.bench.timeline_analysis import Span

ARRIVE = "wire.arrive"  # a message reassembled (`rpc.wire.Reassembler.add`), in any process
SEGMENTS = ("before the write", "to the service", "queued", "hand-off in", "the service's batch",
            "hand-off out", "back to the router", "after the answer")  # fmt: skip
CALLS = (("router.verify_call", "target"), ("router.draft_call", "draft"))


class _Index:
    """One (process, label)'s spans sorted by start, for the first or last one in a window."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.by: dict[tuple[str, str], list[Span]] = {}
        for s in sorted(spans, key=lambda s: s.start):
            self.by.setdefault((s.process, s.label), []).append(s)
        self.starts = {k: [s.start for s in v] for k, v in self.by.items()}

    def first(self, process: str, label: str, lo: int, hi: int) -> Span | None:
        """The first span starting in [lo, hi]."""
        key = (process, label)
        spans = self.by.get(key, [])
        i = bisect.bisect_left(self.starts.get(key, []), lo)
        return spans[i] if i < len(spans) and spans[i].start <= hi else None

    def last_ending(self, process: str, label: str, lo: int, hi: int) -> Span | None:
        """The span that started last in [lo, hi] and ended by ``hi``."""
        key = (process, label)
        spans = self.by.get(key, [])
        i = bisect.bisect_right(self.starts.get(key, []), hi)
        for s in reversed(spans[:i]):
            if s.start < lo:
                return None
            if s.end <= hi:
                return s
        return None


def call_segments(idx: _Index, call: Span, service: str) -> list[int] | None:
    """The call's segments (ns, in `SEGMENTS`' order), or None if a span is missing."""
    write = idx.first("router", "router.stream_write", call.start, call.end)
    if write is None:
        return None
    step = idx.first(service, "service.step", write.start, call.end)
    if step is None:
        return None
    batch = idx.first(service, f"{service}.rpc_batch", step.start, step.end)
    arrived = idx.last_ending(service, ARRIVE, write.start, step.start)
    back = idx.first("router", ARRIVE, step.end, call.end)
    if batch is None or arrived is None or back is None:
        return None
    marks = [call.start, write.start, arrived.end, step.start, batch.start, batch.end, step.end,
             back.end, call.end]  # fmt: skip
    return [b - a for a, b in itertools.pairwise(marks)]


def hop_segments(
    spans: Sequence[Span], in_round: Callable[[int], bool] = lambda t: True
) -> dict[str, dict[str, float]]:
    """Per call kind ("router.verify_call"...): the mean ms of each segment over the calls that
    start ``in_round``, and ``calls``, how many were whole. Empty without a service process (in
    process)."""
    idx = _Index(spans)
    out: dict[str, dict[str, float]] = {}
    for label, service in CALLS:
        calls = [c for c in idx.by.get(("router", label), []) if in_round(c.start)]
        whole = [seg for c in calls if (seg := call_segments(idx, c, service)) is not None]
        if whole:
            means = [sum(col) / len(whole) / 1e6 for col in zip(*whole, strict=True)]
            out[label] = dict(zip(SEGMENTS, means, strict=True)) | {"calls": len(whole)}
    return out


def format_hops(hops: dict[str, dict[str, float]]) -> str:
    """Markdown: a row per segment, a column per call kind (ms per call, means)."""
    if not hops:
        return ""
    kinds = list(hops)
    lines = ["| segment (ms per call, mean) | " + " | ".join(kinds) + " |",
             "|---|" + "---|" * len(kinds)]  # fmt: skip
    for seg in SEGMENTS:
        lines.append(f"| {seg} | " + " | ".join(f"{hops[k][seg]:.3f}" for k in kinds) + " |")
    total = " | ".join(f"{sum(hops[k][s] for s in SEGMENTS):.3f}" for k in kinds)
    calls = " | ".join(str(int(hops[k]["calls"])) for k in kinds)
    return "\n".join([*lines, f"| the call | {total} |", f"| calls | {calls} |"])
