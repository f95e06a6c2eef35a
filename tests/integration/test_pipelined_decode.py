"""Pipelined plain decoding (`specmesh.router.round`): the router sends a request's next decode
step to the target before it emits the last one, over a real gRPC target.

The router core runs over a `GrpcTargetClient` whose `send_verify` is counted: greedy output
equals transformers' whether the steps go ahead or not, requests that join a micro-batch whose
others have a step in flight get their own verify beside it, and a request that stops (a stop
token, a client that cancels) with a step in flight leaves nothing held in the target. Requests
preempted for KV space, and a request replayed when its draft recovers (it leaves with a step in
flight), come out exact too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PATIENT_DRAFT, until, within
from grpc_harness import LoopThread, serve_target
from procs import is_empty

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.errors import KVCacheFullError, ServiceDownError
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.core import RouterCore
from specmesh.router.grpc_clients import GrpcTargetClient
from specmesh.router.in_process import InProcessDraft
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90]]
LENGTHS = [14, 9, 11, 20]


class CountingTarget(GrpcTargetClient):
    """Counts the verifies sent ahead, the fresh ones, and the requests their answers refused
    for want of KV slots."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.ahead = self.fresh = self.kv_full = 0

    async def send_verify(self, inputs, rows=True):
        self.ahead += 1
        return self._counted(await super().send_verify(inputs, rows))

    async def verify(self, inputs, rows=True):  # the base's goes through send_verify: uncounted
        self.fresh += 1
        return await self._counted(await super().send_verify(inputs, rows))

    async def _counted(self, answer):
        out = await answer
        self.kv_full += sum(isinstance(e, KVCacheFullError) for e in out.errors.values())
        return out


@pytest.fixture(scope="module")
def target(tiny_dir: Path, oracle):
    loop = LoopThread()
    servicer = loop.run(serve_target(TargetRuntime(TargetConfig(str(tiny_dir / "target")))))
    model_dir = str(tiny_dir / "target")
    yield SimpleNamespace(
        loop=loop,
        servicer=servicer,
        address=f"127.0.0.1:{servicer.host.port}",
        expected=lambda prompt, n, stop=(): oracle(model_dir, prompt, n, stop),
    )
    loop.run(servicer.host.shutdown(0.5))
    loop.close()


async def _generate(core: RouterCore, rid: str, prompt: list[int], params) -> list[int]:
    return await _collect(core, Request(rid, prompt, params, core.info.eos_token_ids))


async def _collect(core: RouterCore, req: Request) -> list[int]:
    return [t async for chunk in core.generate(req) for t in chunk.token_ids]


def _run(target, scenario, drafts=(), **cfg):
    """``scenario(core)`` against a fresh router core over the target: its result, the client,
    and whether the target still held anything for the core's stream once every request ended
    (asked before the stream closes: closing it frees what it owned)."""

    async def main():
        client = CountingTarget(target.address)
        await client.connect()
        core = RouterCore([client], drafts, RouterConfig(**{**PATIENT_DRAFT, **cfg}))
        await core.start()
        try:
            result = await within(scenario(core), "the scenario")
            held = await _still_held(target.servicer)
        finally:
            await core.stop()
            await client.close()
        return result, client, held

    return target.loop.run(main())


async def _still_held(servicer, timeout_s: float = 10.0) -> bool:
    """Whether the target holds a request or KV past ``timeout_s`` (releases are in-band)."""
    for _ in range(int(timeout_s / 0.01)):
        if is_empty(servicer.info(servicer.runtime).occupancy):
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "off"])
def test_plain_decoding_matches_transformers(target, pipeline: bool) -> None:
    async def scenario(core):
        runs = [_generate(core, f"r{k}", p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for k, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))]  # fmt: skip
        return await asyncio.gather(*runs)

    outputs, client, held = _run(target, scenario, pipeline_decode=pipeline)
    for prompt, n, ids in zip(PROMPTS, LENGTHS, outputs, strict=True):
        assert ids == target.expected(prompt, n)
    # each decode step after a request's first goes ahead (its first follows its prefill)
    assert (client.ahead > 0) == pipeline
    assert not held


def test_a_request_joining_steps_in_flight_gets_its_own_verify(target) -> None:
    """One micro-batch: the second request joins while the first's step is in flight; both
    rounds' answers are joined, and both outputs stay exact."""

    async def scenario(core):
        a = Request("a", PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))
        first = asyncio.ensure_future(_collect(core, a))
        while len(a.output_ids) < 4:
            await asyncio.sleep(0.001)
        second = await _generate(core, "b", PROMPTS[2], SamplingParams(max_new_tokens=8))
        return await first, second, core

    (first, second, _), client, held = _run(target, scenario, num_micro_batches=1)
    assert first == target.expected(PROMPTS[0], 24)
    assert second == target.expected(PROMPTS[2], 8)
    assert client.ahead > 0 and client.fresh >= 2  # the joiner's verify beside the one ahead
    assert not held


def test_stopping_with_a_step_in_flight_leaves_nothing_held(target) -> None:
    """A stop token ends the request with its next step already sent; a cancelled client ends
    another mid-stream: both are released behind that step, and nothing stays in the target."""
    full = target.expected(PROMPTS[3], 20)
    stop = full[6]

    async def scenario(core):
        params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop], ignore_eos=True)
        stopped = await _generate(core, "s", PROMPTS[3], params)
        gen = core.generate(Request("c", PROMPTS[1], SamplingParams(max_new_tokens=30)))
        seen = []
        async for chunk in gen:
            seen += chunk.token_ids
            if len(seen) >= 5:
                break
        await gen.aclose()
        for _ in range(200):  # the worker retires the aborted request between rounds
            if not core.slots:
                break
            await asyncio.sleep(0.01)
        return stopped, seen

    (stopped, seen), client, held = _run(target, scenario)
    assert stopped == full[: full.index(stop) + 1]
    assert seen[:5] == target.expected(PROMPTS[1], 5)
    assert client.ahead > 0
    assert not held


def test_a_verify_without_rows_returns_no_features_and_the_same_tokens(target) -> None:
    """The router asks no feature rows for a step whose requests have no draft
    (``skip_features``): an EAGLE-3 stream's verify then returns none, its tokens unchanged, and
    the target's run-ahead decides the next step without them too."""
    runtime = target.servicer.runtime

    async def main():
        client = GrpcTargetClient(target.address)
        await client.connect()
        await client.configure(FeatureSpec(Feature.AUX_HIDDEN))
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        out = await client.prefill([PrefillInput("f", PROMPTS[0], params)])
        tokens, outs = [out.tokens["f"][-1]], []
        for rows in (True, False, False):
            hits = runtime.ahead.num_hits
            outs.append(await client.verify([VerifyInput("f", DraftTree.chain(tokens[-1:]))], rows))
            tokens.append(outs[-1].tokens["f"][-1])
            outs[-1].hit = runtime.ahead.num_hits > hits
        await client.release(["f"])
        await client.close()
        return tokens, outs

    tokens, (with_rows, first_without, second_without) = target.loop.run(main())
    assert tokens == target.expected(PROMPTS[0], 4)
    assert with_rows.features is not None and with_rows.row_counts == {"f": 1}
    assert first_without.features is None and second_without.features is None
    # decided with rows, asked without: a miss; then decided and asked without: a hit
    assert (with_rows.hit, first_without.hit, second_without.hit) == (False, False, True)


def test_requests_preempted_with_a_step_in_flight_are_replayed_exactly(target) -> None:
    """A target with 64 KV slots for 6 requests that want 144 at the end: running requests are
    preempted (their steps sent ahead answered with a full cache, or dropped when they leave)
    and replayed from what was streamed; every output equals transformers' and nothing is held
    afterwards. A replay that kept its old placement's step in flight would emit its token."""
    model_dir = target.servicer.runtime.cfg.model_dir
    small = TargetRuntime(TargetConfig(model_dir, num_kv_slots=64))
    servicer = target.loop.run(serve_target(small))
    tight = SimpleNamespace(
        loop=target.loop, servicer=servicer, address=f"127.0.0.1:{servicer.host.port}"
    )
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(6)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def scenario(core):
        runs = [_generate(core, f"p{k}", p, params) for k, p in enumerate(prompts)]
        return await asyncio.gather(*runs)

    try:
        outputs, client, held = _run(tight, scenario, max_batch_size=6, num_micro_batches=1)
    finally:
        target.loop.run(servicer.host.shutdown(0.5))
    assert client.kv_full > 0 and client.ahead > 0  # preempted with steps sent ahead
    assert outputs == [target.expected(p, 16) for p in prompts]
    assert not held


class FlakyDraft(InProcessDraft):
    """A self-draft whose second step fails (a mid-generation outage), then works; counts the
    steps that extended request "a"."""

    calls = steps_for_a = 0

    async def step(self, extends, propose=True):
        self.calls += 1
        if self.calls == 2:
            raise ServiceDownError(f"{self.name}: connection reset")
        self.steps_for_a += any(e.rid == "a" for e in extends)
        return await super().step(extends, propose)


def test_speculation_resumes_with_a_step_in_flight(target) -> None:
    """A request that lost its draft decodes plain, its steps sent ahead; when the draft serves
    again it is replayed (it leaves with a step in flight) and speculates again. Its output is
    transformers', and the replay never reads the step its old placement sent."""
    model_dir = target.servicer.runtime.cfg.model_dir
    draft = FlakyDraft(
        load_draft(DraftConfig("standalone", model_dir, model_dir, SpecParams(3, 1, 4)))
    )

    async def scenario(core):
        a = Request("a", [5, 6, 7], SamplingParams(max_new_tokens=150, ignore_eos=True))
        first = asyncio.ensure_future(_collect(core, a))
        await until(
            lambda: draft.calls >= 2 and core.slots["a"].placement.draft is None,
            "the outage taking request a's draft",
        )  # fmt: skip
        steps_before = draft.steps_for_a
        # A new request gets the draft (no cooldown); its successful step closes the breaker.
        await within(_generate(core, "b", [9, 9], SamplingParams(max_new_tokens=2)), "request b")
        tokens = await within(first, "request a")
        return tokens, a.accept_lens, draft.steps_for_a - steps_before

    (tokens, accept_lens, resumed_steps), client, held = _run(
        target, scenario, drafts=[draft], draft_cooldown_s=0.0, resume_min_remaining=8,
        num_micro_batches=1,
    )  # fmt: skip
    assert tokens == target.expected([5, 6, 7], 150)
    assert 1 in accept_lens and client.ahead > 0  # plain, pipelined, during the outage
    assert resumed_steps > 0 and accept_lens[-2] == 4  # the self-draft's 3 + bonus, again
    assert not held
