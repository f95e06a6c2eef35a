"""A KV cache too small for every request at once: requests wait or are preempted and replayed,
never lost, and every output still equals transformers; a replayed request leaves nothing in the
draft either (issue 33 item 6)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import assert_speculated
from oracle_draft import mean_accept, oracle_engine

from specmesh.protocol.config import SpecParams, TargetConfig
from specmesh.protocol.errors import DuplicateRequestError, InvalidRequestError, KVCacheFullError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.policy import Plan
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig
from specmesh.target_service.runtime import TargetRuntime
from specmesh.target_service.verify import Tree

CASES = ("eagle3", "oracle", "failing_draft", "no_speculation")


def _engine(tiny_dir: Path, case: str) -> Engine:
    """6 requests of 8 + 16 tokens want 144 KV slots at the end; the target has 64."""
    target_config = {"num_kv_slots": 64}
    router_config = RouterConfig(max_batch_size=6, num_micro_batches=1)
    if case == "oracle":  # accepts 2.5 tokens per round, through trees of up to 7 nodes
        return oracle_engine(tiny_dir / "target", target_config=target_config,
                             router_config=router_config)  # fmt: skip
    return Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 2, 6), target_config=target_config, router_config=router_config,
    )  # fmt: skip


def _count_kv_full(monkeypatch: pytest.MonkeyPatch, target: TargetRuntime) -> Counter:
    """Requests each target step refused for want of KV slots, by step (``prefill``: a new or
    replayed request waits; ``verify``: a running request is preempted)."""
    refused: Counter = Counter()

    def counting(step: str) -> Callable[..., StepOutput]:
        call = getattr(target, step)

        def counted(*args: object) -> StepOutput:
            out = call(*args)
            refused[step] += sum(isinstance(e, KVCacheFullError) for e in out.errors.values())
            return out

        return counted

    for step in ("prefill", "verify"):
        monkeypatch.setattr(target, step, counting(step))
    return refused


@pytest.mark.parametrize("case", CASES)
def test_small_kv_cache_preempts_and_replays(
    tiny_dir: Path, oracle, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Whatever a round verifies (a draft's tree, or a bare root when the draft fails on every
    call or speculation is off), a request that does not fit waits or is preempted, then is
    replayed: outputs equal transformers greedy and every KV slot comes back."""
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(6)]
    engine = _engine(tiny_dir, case)
    draft_calls = Counter()
    if case == "failing_draft":

        def propose(rids: list[str], roots: list[int]) -> list[Tree]:
            draft_calls["propose"] += 1
            raise RuntimeError("draft broke")

        monkeypatch.setattr(engine.draft.drafter, "propose", propose)
    refused = _count_kv_full(monkeypatch, engine.target)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    results = engine.generate(prompts, params, disable_speculation=case == "no_speculation")
    for prompt, res in zip(prompts, results, strict=True):
        assert res.finish_reason == "length"
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 16)
    assert refused["verify"] >= 1 and refused["prefill"] >= 1, refused  # pressure, every case
    if case in ("eagle3", "oracle"):
        assert_speculated(results, min_mean_accept=2.0 if case == "oracle" else 1.0)
    if case in ("failing_draft", "no_speculation"):  # every round decoded one token
        assert mean_accept(results) == 1.0
    assert (draft_calls["propose"] >= 1) == (case == "failing_draft")
    assert not engine.target.cache.requests and engine.target.kv_slots() == (0, 64)


def test_request_that_never_fits_fails_once_alone(tiny_dir: Path, oracle) -> None:
    """A prompt larger than the whole cache fails at once (INVALID_ARGUMENT: it can never fit,
    so it neither waits for other requests nor is retried), in whichever micro-batch it lands;
    two such prompts never wait for each other. The other request is served."""
    engine = Engine(tiny_dir / "target", target_config={"num_kv_slots": 16})
    prefills = Counter()

    def bounded(inputs: list[PrefillInput], *args: object) -> StepOutput:
        prefills["calls"] += 1
        assert prefills["calls"] <= 200, "requests that never fit are retried forever"
        return prefill(inputs, *args)

    prefill, engine.target.prefill = engine.target.prefill, bounded
    big = [[5 + i, *range(6, 26)] for i in range(2)]  # 21 tokens: never fit in 16 slots
    small = [5, 6, 7, 8]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    reqs = [engine.make_request(p, params) for p in [*big, small]]
    results = asyncio.run(_serve(engine, reqs))
    assert all(isinstance(r, InvalidRequestError) for r in results[:2]), results
    assert "more KV than the whole cache holds (16 slots)" in str(results[0])
    assert prefills["calls"] <= 2  # refused before any wait: no retries
    assert results[2].token_ids == oracle(tiny_dir / "target", small, 4)
    assert not engine.target.cache.requests and engine.target.kv_slots() == (0, 16)


async def _serve(engine: Engine, reqs: list[Request]) -> list[object]:
    """Every request's result or error (`Engine.generate` stops at the first error)."""
    core = RouterCore([InProcessTarget(engine.target)], [], engine.router_config)
    await core.start()
    try:
        runs = (Engine._collect(core, r) for r in reqs)
        return await asyncio.gather(*runs, return_exceptions=True)
    finally:
        await core.stop()


def test_verify_that_does_not_fit_fails_alone(tiny_dir: Path) -> None:
    rt = TargetRuntime(TargetConfig(str(tiny_dir / "target"), num_kv_slots=24))
    rt.prefill([PrefillInput("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams()),
                PrefillInput("b", [1, 2, 3], SamplingParams())])  # fmt: skip
    big = DraftTree.chain(
        [rt.requests["a"].pending, *range(20, 32)]
    )  # 13 nodes: more than the 11 slots left
    small = DraftTree.chain([rt.requests["b"].pending, 20])
    out = rt.verify([VerifyInput("a", big), VerifyInput("b", small)])
    assert isinstance(out.errors["a"], KVCacheFullError) and "13-node tree" in str(out.errors["a"])
    assert len(out.tokens["b"]) >= 1 and "a" not in rt.requests  # a failed request is dropped
    assert "a" not in rt.cache.requests


# -- a replay's draft state (issue 33 item 6) --------------------------------------------------
REPLAY_SLOTS = 160  # 8 prompts of 24 tokens want 192 to start


def _watch(core: RouterCore) -> Counter:
    """Counts, through the core's clients: requests the target's verifies preempted
    (``preempted``), later prefill pieces of replays (``replay_pieces``: a replayed context is
    prefilled in pieces), and draft answers ALREADY_EXISTS (``duplicates``). The policy plans
    plain decoding (each request's draft start waits in its backlog) until the first
    preemption, then full trees (the replays' draft extends go out)."""
    seen, target, draft = Counter(), core.targets[0], core.drafts[0]
    verify, prefill, step = target.verify, target.prefill, draft.step

    async def watched_verify(inputs: list[VerifyInput], rows: bool = True) -> StepOutput:
        out = await verify(inputs, rows)
        seen["preempted"] += sum(isinstance(e, KVCacheFullError) for e in out.errors.values())
        return out

    async def watched_prefill(inputs: list[PrefillInput]) -> StepOutput:
        seen["replay_pieces"] += sum(i.sample_offset > 0 and i.input_start > 0 for i in inputs)
        return await prefill(inputs)

    async def watched_step(extends, propose: bool = True):
        res = await step(extends, propose)
        seen["duplicates"] += sum(isinstance(e, DuplicateRequestError) for e in res.errors.values())
        return res

    def plan(target: str, draft: str, batch_size: int, requests, max_nodes: int) -> Plan:
        return Plan(max_nodes if seen["preempted"] else 1)

    target.verify, target.prefill, draft.step = watched_verify, watched_prefill, watched_step
    core.policy.plan = plan
    return seen


async def _run_cancelling(core: RouterCore, reqs: list[Request], cancel_after: dict[int, int]):
    """Every request's tokens; request i's client cancels after reading ``cancel_after[i]``
    chunks (None for it)."""

    async def one(i: int) -> list[int] | None:
        tokens, num_chunks = [], 0
        async with contextlib.aclosing(core.generate(reqs[i])) as chunks:
            async for chunk in chunks:
                tokens += chunk.token_ids
                num_chunks += 1
                if num_chunks == cancel_after.get(i):
                    return None  # closing the iteration aborts the request
        return tokens

    return await asyncio.gather(*(one(i) for i in range(len(reqs))))


def test_replays_after_preemption_leave_nothing_in_the_draft(tiny_dir: Path, oracle) -> None:
    """A request preempted while its draft start still waited in its backlog is replayed in
    pieces (its context outgrew the prefill budget). Its replay starts its draft state once:
    the stale start once went out again behind the replay's first piece, the draft answered
    ALREADY_EXISTS and the router dropped it there without a release, so the draft held it
    until the router restarted. With cancels among them, target and draft hold nothing after,
    and the requests not cancelled equal transformers."""
    engine = Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 2, 6), target_config={"num_kv_slots": REPLAY_SLOTS},
    )  # fmt: skip
    prompts = [[5 + i, *range(30, 53)] for i in range(8)]  # 24 tokens: one piece each
    cfg = RouterConfig(max_batch_size=8, num_micro_batches=1, prefill_chunk_tokens=24)
    cancel_after = {2: 3, 5: 1}
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def scenario() -> tuple[list[list[int] | None], Counter]:
        core = RouterCore([InProcessTarget(engine.target)], [InProcessDraft(engine.draft)], cfg)
        seen = _watch(core)
        await core.start()
        try:
            reqs = [engine.make_request(p, params) for p in prompts]
            return await _run_cancelling(core, reqs, cancel_after), seen
        finally:
            await core.stop()

    outputs, seen = asyncio.run(scenario())
    for i, tokens in enumerate(outputs):
        expected = None if i in cancel_after else oracle(tiny_dir / "target", prompts[i], 16)
        assert tokens == expected, i
    assert seen["preempted"] >= 1 and seen["replay_pieces"] >= 1, seen  # the path ran
    assert seen["duplicates"] == 0
    assert engine.draft.live == {} and engine.draft.kv_slots()[0] == 0
    assert not engine.target.cache.requests
    assert engine.target.kv_slots()[1] == REPLAY_SLOTS
