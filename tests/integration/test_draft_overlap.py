"""The draft works while the router emits (`RoundRunner._overlapped`): after a verify the draft's
step is written first, and the round's tokens are emitted (stop rules, detokenizing, streaming)
while the draft extends and proposes. Over a real gRPC target and draft (a standalone
self-draft: high acceptance, several tokens a round).

Checked: each draft step goes out before the round it follows is emitted (the request has not
yet streamed that round's tokens when the draft is called); a request that a stop token ends
in the emit, with its draft step in flight, drops that step's answer, and neither service holds
anything afterwards; output equals transformers' throughout.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PATIENT_DRAFT
from grpc_harness import LoopThread, serve_draft, serve_target
from procs import is_empty

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.grpc_clients import GrpcDraftClient, GrpcTargetClient
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig
from specmesh.target_service.runtime import TargetRuntime

PROMPT = [5, 6, 7, 8]


class WatchedDraft(GrpcDraftClient):
    """Records, for each step that continues request "a", how many tokens "a" had emitted when
    the step was called."""

    def __init__(self, address: str, core_of) -> None:
        super().__init__(address)
        self.core_of, self.emitted_at_step = core_of, []

    async def step(self, extends, propose=True):
        for e in extends:
            if e.rid == "a" and not e.new:
                self.emitted_at_step.append(self.core_of().slots["a"].request.num_generated)
        return await super().step(extends, propose)


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, oracle):
    loop = LoopThread()
    model_dir = str(tiny_dir / "target")
    draft_cfg = DraftConfig("standalone", model_dir, model_dir, SpecParams(3, 1, 4))
    target = loop.run(serve_target(TargetRuntime(TargetConfig(model_dir))))
    draft = loop.run(serve_draft(load_draft(draft_cfg)))
    yield SimpleNamespace(
        loop=loop,
        target=target,
        draft=draft,
        expected=lambda prompt, n, stop=(): oracle(model_dir, prompt, n, stop),
    )
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _run(stack, scenario):
    """``scenario(core)`` over a fresh router core: its result, the draft client, and whether
    either service still held anything once every request ended (asked while the streams are
    open: closing them frees what they owned)."""

    async def main():
        cores = []
        target = GrpcTargetClient(f"127.0.0.1:{stack.target.host.port}")
        draft = WatchedDraft(f"127.0.0.1:{stack.draft.host.port}", lambda: cores[0])
        await asyncio.gather(target.connect(), draft.connect())
        core = RouterCore([target], [draft], RouterConfig(speculation="always", **PATIENT_DRAFT))
        cores.append(core)
        await core.start()
        try:
            result = await scenario(core)
            held = await _still_held(stack.target, stack.draft)
        finally:
            await core.stop()
            await asyncio.gather(target.close(), draft.close())
        return result, draft, held

    return stack.loop.run(main())


async def _still_held(*servicers, timeout_s: float = 10.0) -> bool:
    """Whether a service holds a request or KV past ``timeout_s`` (releases are in-band)."""
    for _ in range(int(timeout_s / 0.01)):
        if all(is_empty(s.info(s.runtime).occupancy) for s in servicers):
            return False
        await asyncio.sleep(0.01)
    return True


async def _generate(core: RouterCore, rid: str, params: SamplingParams) -> Request:
    req = Request(rid, PROMPT, params, core.info.eos_token_ids)
    async for _ in core.generate(req):
        pass
    return req


def test_the_draft_is_called_before_the_round_is_emitted(stack) -> None:
    async def scenario(core):
        return await _generate(core, "a", SamplingParams(max_new_tokens=40, ignore_eos=True))

    req, draft, held = _run(stack, scenario)
    assert req.output_ids == stack.expected(PROMPT, 40)
    rounds = req.accept_lens
    assert max(rounds) > 1 and len(draft.emitted_at_step) == len(rounds) - 1
    # The step after round k: the prefill's token and rounds before k were emitted, not k's.
    assert draft.emitted_at_step == [1 + sum(rounds[:k]) for k in range(len(rounds) - 1)]
    assert not held


def test_a_request_stopped_in_the_emit_drops_its_draft_step(stack) -> None:
    """A stop token inside a round's accepted tokens ends the request while the draft step
    sent for it runs; its answer is dropped, and the release that followed it on the draft's
    stream leaves the draft empty."""
    full = stack.expected(PROMPT, 40)
    stop = full[9]

    async def scenario(core):
        params = SamplingParams(max_new_tokens=40, stop_token_ids=[stop], ignore_eos=True)
        return await _generate(core, "a", params), core

    (req, core), draft, held = _run(stack, scenario)
    assert req.output_ids == full[: full.index(stop) + 1]
    # the round that emitted the stop token had its draft step sent before that emit
    assert len(draft.emitted_at_step) == len(req.accept_lens)
    assert "a" not in core.slots
    assert not held
