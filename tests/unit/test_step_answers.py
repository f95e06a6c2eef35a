"""`StepAnswers`: a stream's answers are written one at a time and in the order they were
given, whether written at once (`write_now`) or queued (`write`, a held batch's answer)."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.rpc.held_batches import StepAnswers


class _Wire:
    """A write that records when it starts and ends, taking two turns of the loop between (as
    gRPC's does): two writes overlapping would show as interleaved marks."""

    def __init__(self) -> None:
        self.marks: list[str] = []

    async def write(self, messages: list) -> None:
        self.marks.append(f"start {messages[0]}")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.marks.append(f"end {messages[0]}")


def test_write_now_starts_before_any_turn_of_the_loop() -> None:
    async def run() -> list[str]:
        wire = _Wire()
        answers = StepAnswers(wire.write)
        written = asyncio.ensure_future(answers.write_now(["a"]))
        await asyncio.sleep(0)  # one turn: the write has started, not finished
        seen = list(wire.marks)
        await written
        return [*seen, *wire.marks]

    assert asyncio.run(run()) == ["start a", "start a", "end a"]


def test_writes_never_overlap_and_keep_their_order() -> None:
    """A queued write still running when `write_now` comes: it waits its turn; a write queued
    while `write_now` runs goes after it."""

    async def run() -> list[str]:
        wire = _Wire()
        answers = StepAnswers(wire.write)
        answers.write(["held"])  # a held batch's answer, as a task
        now = asyncio.ensure_future(answers.write_now(["now"]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        answers.write(["later"])  # queued while "now" may still be writing
        await now
        await answers.written()
        return wire.marks

    assert asyncio.run(run()) == [
        "start held", "end held", "start now", "end now", "start later", "end later"
    ]  # fmt: skip


def test_a_failed_write_now_raises_and_fails_the_writes_behind_it() -> None:
    async def run() -> None:
        async def broken(messages: list) -> None:
            raise ConnectionError("stream broke")

        answers = StepAnswers(broken)
        with pytest.raises(ConnectionError):
            await answers.write_now(["a"])
        answers.write(["b"])
        await answers.written()

    with pytest.raises(ConnectionError):
        asyncio.run(run())
