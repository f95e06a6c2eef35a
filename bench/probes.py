"""Timing proxies around the router's model clients, and the time split they yield.

`TimedTarget` / `TimedDraft` forward every call of the `TargetClient` / `DraftClient` protocol
and record its (start, end) interval in a shared `CallLog`. The split of one run's wall time:

    target_s  = total time inside target calls        (the forward itself, waiting for the
    draft_s   = total time inside draft calls          target's lock included)
    router_s  = wall - |union of all call intervals|   (time no model call was in flight)

With two micro-batches a target and a draft call can overlap, so target_s + draft_s may exceed
the busy time; router_s counts only time when neither was running.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class CallLog:
    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    async def timed(self, kind: str, call: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter()
        try:
            return await call()
        finally:
            self.intervals.setdefault(kind, []).append((start, time.perf_counter()))

    def total_s(self, kind: str) -> float:
        return sum(end - start for start, end in self.intervals.get(kind, []))

    def busy_s(self) -> float:
        """Length of the union of every recorded interval."""
        spans = sorted(iv for ivs in self.intervals.values() for iv in ivs)
        busy, cur_start, cur_end = 0.0, None, None
        for start, end in spans:
            if cur_end is None or start > cur_end:
                busy += 0.0 if cur_end is None else cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        return busy + (0.0 if cur_end is None else cur_end - cur_start)


class TimedTarget:
    def __init__(self, inner: Any, log: CallLog) -> None:
        self.inner, self.log = inner, log
        self.info, self.name = inner.info, inner.name
        self.remote = False  # each verify is timed whole: no step sent ahead

    async def configure(self, draft: Any) -> None:
        await self.inner.configure(draft)

    async def prefill(self, inputs: list) -> Any:
        return await self.log.timed("target", lambda: self.inner.prefill(inputs))

    async def verify(self, inputs: list, rows: bool = True) -> Any:
        return await self.log.timed("target", lambda: self.inner.verify(inputs, rows))

    async def release(self, rids: list[str]) -> None:
        await self.log.timed("target", lambda: self.inner.release(rids))


class TimedDraft:
    def __init__(self, inner: Any, log: CallLog) -> None:
        self.inner, self.log = inner, log
        self.info, self.name = inner.info, inner.name

    async def step(self, extends: list, propose: bool = True) -> Any:
        return await self.log.timed("draft", lambda: self.inner.step(extends, propose))

    async def release(self, rids: list[str]) -> None:
        await self.log.timed("draft", lambda: self.inner.release(rids))

    async def prepare(self, constraints: list) -> None:
        await self.inner.prepare(constraints)  # a write, not a step: not timed


def time_split(log: CallLog, wall_s: float) -> dict[str, Any]:
    """The in-process split (the cluster reports none: its router is another process)."""
    target_s, draft_s = log.total_s("target"), log.total_s("draft")
    return {
        "wall_s": wall_s,
        "target_s": target_s,
        "draft_s": draft_s,
        "router_s": max(0.0, wall_s - log.busy_s()),
        "network_s": 0.0,
        "note": "in process: no network",
    }
