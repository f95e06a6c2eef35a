"""After a draft failure, requests continue without speculation; once the draft serves a step
successfully again, they are replayed with a draft and speculate again. Output is unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import until, within

from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import ServiceDownError
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.router_config import RouterConfig


class FlakyDraft(InProcessDraft):
    """Fails its ``fail_at``-th step (a mid-generation outage), then works."""

    calls, fail_at = 0, 2

    async def step(self, extends, propose=True):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ServiceDownError(f"{self.name}: connection reset")
        return await super().step(extends, propose)


class PacedTarget(InProcessTarget):
    """Yields the loop a few ms before each verify while ``paced``: the request that lost its
    draft is still decoding when the breaker's cooldown has passed and the probe has run (an
    in-process step runs inline and would otherwise race through its tokens)."""

    paced = True

    async def verify(self, inputs, rows=True):
        if self.paced:
            await asyncio.sleep(0.005)
        return await super().verify(inputs, rows)


def test_speculation_resumes_after_the_draft_recovers(tiny_dir: Path, oracle) -> None:
    engine = _self_drafting(tiny_dir)
    cfg = RouterConfig(draft_cooldown_s=0.05, resume_min_remaining=8, num_micro_batches=1)

    async def scenario() -> tuple[list[int], list[int], int]:
        draft, target, core = await _started(engine, cfg, fail_at=2)
        req = engine.make_request([5, 6, 7], SamplingParams(max_new_tokens=150, ignore_eos=True))
        main = asyncio.create_task(_collect(core, req))

        async def outage() -> None:
            await until(lambda: draft.calls >= 2, "the draft's second step (the outage)")
            await asyncio.sleep(0.06)  # the breaker's cooldown passes

        tokens = await _recovered(engine, core, target, main, outage())
        return tokens, req.accept_lens, draft.calls

    tokens, accept_lens, calls = asyncio.run(scenario())
    assert tokens == oracle(tiny_dir / "target", [5, 6, 7], 150)
    assert 1 in accept_lens, "the request decoded without speculation during the outage"
    assert accept_lens[-2] == 4, (
        f"speculation (self-draft: 3 + bonus) did not resume: {accept_lens}"
    )
    assert calls > 3


class LateFailure(InProcessDraft):
    """A step over committed ids that hold ``stop`` fails, once ``request`` has finished: the
    round's emit ended it on that stop token and it left while the step was out."""

    stop, request = -1, None

    async def step(self, extends, propose=True):
        if any(self.stop in e.committed_ids for e in extends):
            await until(lambda: self.request.finished, "the request's end at the emit")
            raise ServiceDownError(f"{self.name}: connection reset")
        return await super().step(extends, propose)


def test_a_draft_failure_after_its_request_left_leaves_no_record(tiny_dir: Path, oracle) -> None:
    """The draft step of a request's last round fails after the round's emit finished the
    request (a stop token it accepted) and it left its replicas: the router keeps no record of
    it as waiting for a draft (`RouterCore.draftless`), and no service holds it."""
    engine = _self_drafting(tiny_dir)
    expected = oracle(tiny_dir / "target", [5, 6, 7], 24)
    end = next(i for i, t in enumerate(expected) if i >= 6 and t not in [5, 6, 7, *expected[:i]])

    async def scenario() -> tuple[list[int], set[str]]:
        draft = LateFailure(engine.draft)
        core = RouterCore([InProcessTarget(engine.target)], [draft], RouterConfig())
        await core.start()
        try:
            params = SamplingParams(max_new_tokens=24, stop_token_ids=[expected[end]])
            draft.stop, draft.request = expected[end], engine.make_request([5, 6, 7], params)
            tokens = await within(_collect(core, draft.request), "the request")
            await until(lambda: core.replicas.drafts[0].breaker.failures, "the draft's failure")
            return tokens, set(core.draftless)
        finally:
            await within(core.stop(), "the router's stop")

    tokens, draftless = asyncio.run(scenario())
    assert tokens == expected[: end + 1]
    assert not draftless, f"a request that left waits for a draft: {draftless}"
    assert not engine.draft.live and engine.target.num_requests == 0


def _self_drafting(tiny_dir: Path) -> Engine:
    """The tiny target drafting for itself (a standalone draft: every draft token accepted)."""
    return Engine(
        tiny_dir / "target", draft_model=tiny_dir / "target", draft_kind="standalone",
        spec=SpecParams(3, 1, 4),
    )  # fmt: skip


async def _started(
    engine: Engine, cfg: RouterConfig, fail_at: int
) -> tuple[FlakyDraft, PacedTarget, RouterCore]:
    """A router over the engine's runtimes whose draft fails its ``fail_at``-th step."""
    draft, target = FlakyDraft(engine.draft), PacedTarget(engine.target)
    draft.fail_at = fail_at
    core = RouterCore([target], [draft], cfg)
    await core.start()
    return draft, target, core


async def _recovered(
    engine: Engine, core: RouterCore, target: PacedTarget, main: asyncio.Task, outage
) -> list[int]:
    """After ``outage`` (awaited), a new request gets the draft and its successful step closes
    the breaker; then the tokens of ``main``, the request that lost (or never had) its draft,
    unpaced. The router stops either way."""
    try:
        await outage
        probe = engine.make_request([9, 9], SamplingParams(max_new_tokens=2))
        await within(_collect(core, probe), "a request after the outage")
        target.paced = False
        return await within(main, "the request without its draft")
    finally:
        main.cancel()
        await within(core.stop(), "the router's stop")


async def _collect(core: RouterCore, req) -> list[int]:
    return [t async for chunk in core.generate(req) for t in chunk.token_ids]


def test_a_request_admitted_while_no_draft_is_live_gets_one_when_it_recovers(
    tiny_dir: Path, oracle
) -> None:
    """The draft's first step fails (its breaker opens); a request admitted during the cooldown
    is placed without a draft and decodes plainly; once a later request's step closes the
    breaker, it is replayed with the draft and speculates again. Output is unchanged."""
    engine = _self_drafting(tiny_dir)
    cfg = RouterConfig(draft_cooldown_s=60, resume_min_remaining=8, num_micro_batches=1)

    async def scenario() -> tuple[list[int], list[int], bool]:
        _, target, core = await _started(engine, cfg, fail_at=1)
        first = engine.make_request([4, 4], SamplingParams(max_new_tokens=4))
        await within(_collect(core, first), "the request whose draft step fails")
        breaker = core.replicas.drafts[0].breaker
        down = not core.replicas.drafts[0].live  # the cooldown (a minute) is running
        req = engine.make_request([5, 6, 7], SamplingParams(max_new_tokens=150, ignore_eos=True))
        main = asyncio.create_task(_collect(core, req))

        async def outage() -> None:
            await until(lambda: core.draftless, "the request placed without a draft")
            breaker.open_until = 0.0  # the cooldown has passed

        tokens = await _recovered(engine, core, target, main, outage())
        assert not core.draftless
        return tokens, req.accept_lens, down

    tokens, accept_lens, down = asyncio.run(scenario())
    assert down
    assert tokens == oracle(tiny_dir / "target", [5, 6, 7], 150)
    assert accept_lens[0] == 1, "placed without a draft, it decoded plainly first"
    assert accept_lens[-2] == 4, f"speculation did not start once the draft was back: {accept_lens}"
