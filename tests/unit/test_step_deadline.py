"""The adaptive draft deadline: a multiple of the draft's recent p99, between a floor and the
configured maximum."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.faults import StepDeadline
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.router_config import RouterConfig


def test_deadline_is_the_maximum_until_enough_steps_were_seen() -> None:
    d = StepDeadline(max_s=10.0, floor_s=0.5, factor=4.0, min_samples=4)
    for _ in range(3):
        d.observe(0.2)
    assert d.seconds == 10.0
    d.observe(0.2)
    assert d.seconds == 0.8  # 4 x 0.2


def test_deadline_follows_the_p99_within_floor_and_maximum() -> None:
    d = StepDeadline(max_s=10.0, floor_s=0.5, factor=4.0, window=100, min_samples=1)
    for _ in range(100):
        d.observe(0.01)
    assert d.seconds == 0.5  # fast steps: the floor
    for _ in range(2):
        d.observe(1.0)  # 2 slow steps in 100: above the 99th percentile's rank
    assert d.seconds == 4.0
    for _ in range(100):
        d.observe(5.0)  # a draft that got slow for good: capped
    assert d.seconds == 10.0


def test_a_step_over_more_rows_than_the_steady_ones_gets_a_longer_deadline() -> None:
    """A burst of prompts to extend over is more work, not a hang: its deadline is the steady
    one times how many more rows it carries than the median steady step, at most the maximum."""
    d = StepDeadline(max_s=10.0, floor_s=0.05, factor=4.0, min_samples=4)
    assert d.seconds_for(400) == 10.0  # nothing learned yet: the maximum anyway
    for rows in (4, 5, 4, 3, 4):
        d.observe(0.02, rows)
    assert d.seconds == d.seconds_for(4) == d.seconds_for(1) == 0.08
    assert d.seconds_for(40) == pytest.approx(0.8)  # ten times the rows of a steady step
    assert d.seconds_for(4000) == 10.0


def test_a_burst_of_new_requests_is_not_held_to_the_steady_deadline(tiny_dir) -> None:
    """Through a router: once steady rounds taught the deadline, a step that starts many
    requests at once gets a deadline scaled to its rows, and only steady steps are learned."""
    engine = Engine(tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
                    spec=SpecParams(3, 2, 4))  # fmt: skip
    cfg = RouterConfig(speculation="always", draft_deadline_floor_s=0.05, num_micro_batches=1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    burst = [[9, 8, 7, 6, 5, 4, 3, 2][: 2 + i % 6] for i in range(16)]

    async def scenario():
        core = RouterCore([InProcessTarget(engine.target)], [InProcessDraft(engine.draft)], cfg)
        await core.start()
        deadline, asked = core.replicas.drafts[0].deadline, []
        seconds_for = deadline.seconds_for
        deadline.seconds_for = lambda rows: asked.append((rows, seconds_for(rows))) or asked[-1][1]
        try:
            await _run(core, engine, [list(range(5, 13))], params)  # then steady rounds: learned
            learned, steady_s = list(deadline.rows), deadline.seconds
            asked.clear()
            await _run(core, engine, burst, params)
            return learned, steady_s, max(asked)
        finally:
            await core.stop()

    learned, steady_s, (rows, burst_s) = asyncio.run(scenario())
    assert len(learned) >= 16 and max(learned) <= 4  # one round's tokens at most: no prompt
    assert steady_s < 10.0 and rows >= 2 * len(burst) and burst_s > steady_s


async def _run(core: RouterCore, engine: Engine, prompts: list, params: SamplingParams) -> None:
    async def one(prompt: list[int]) -> None:
        async for _ in core.generate(engine.make_request(prompt, params)):
            pass

    await asyncio.gather(*(one(p) for p in prompts))
