"""Awaiting several steps at once, cheaply when there is only one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def together(steps: Iterable[Awaitable[T]]) -> list[T]:
    """`asyncio.gather` of ``steps``, except that a lone step is awaited directly: no task, so
    the message it writes goes out in this turn of the event loop instead of a later one (a
    round is most often one micro-batch on one target and one draft)."""
    steps = list(steps)
    if len(steps) == 1:
        return [await steps[0]]
    return list(await asyncio.gather(*steps))
