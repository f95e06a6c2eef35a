"""A replica's capacity is the router's to respect (issue 33 item 7). Each target and draft
service holds at most ``--max-requests`` requests (its KV request rows; a target refuses a
larger batch whole) and advertises it in GetInfo (``max_batch_size``). A router whose own
micro-batches are larger never sends a replica more: the requests beyond wait in its queue,
and every one is served exactly, none refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpc_harness import (
    SPEC,
    LoopThread,
    generate_all,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.target_service.runtime import TargetRuntime

TARGET_MAX, DRAFT_MAX = 4, 3  # both below the router's micro-batch of 32
PROMPTS = [[5 + k, 6 + 2 * k, 7 + 3 * k, 8] for k in range(10)]
MAX_NEW = 10


@pytest.fixture(scope="module")
def small(tiny_dir: Path, oracle):
    """A target that holds 4 requests and a draft that holds 3, behind a router with the
    default micro-batches (two of 32)."""
    target_dir, draft_dir = str(tiny_dir / "target"), str(tiny_dir / "draft")
    loop = LoopThread()
    target_cfg = TargetConfig(target_dir, max_requests=TARGET_MAX)
    target = loop.run(serve_target(TargetRuntime(target_cfg)))
    draft_cfg = DraftConfig("eagle3", draft_dir, target_dir, SPEC, max_requests=DRAFT_MAX)
    draft = loop.run(serve_draft(load_draft(draft_cfg)))
    router = loop.run(serve_router(target, draft))
    s = SimpleNamespace(loop=loop, target=target, draft=draft, router=router)
    s.client = GenerationClient(f"127.0.0.1:{router.port}")
    s.expected = lambda prompt: oracle(target_dir, prompt, MAX_NEW)
    yield s
    s.client.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def watch(monkeypatch: pytest.MonkeyPatch, servicer, held) -> dict:
    """The largest batch ``servicer`` runs, the most requests it holds after one (``held`` reads
    its runtime), and the status codes of every batch and result."""
    seen, inner = {"batch": 0, "held": 0, "codes": set()}, servicer.run_batch

    def run_batch(runtime, stream, chunks):
        answer = inner(runtime, stream, chunks)
        seen["batch"] = max(seen["batch"], len(answer[0].results))
        seen["held"] = max(seen["held"], held(runtime))
        seen["codes"] |= {answer[0].status.code, *(r.status.code for r in answer[0].results)}
        return answer

    monkeypatch.setattr(servicer, "run_batch", run_batch)
    return seen


def hold_first_prefill(monkeypatch: pytest.MonkeyPatch, core, num_requests: int) -> None:
    """The router's first prefill waits until ``num_requests`` requests arrived: every later
    admission finds them all queued (the replicas' room decides, not arrival times)."""
    client, arrived = core.targets[0], asyncio.Event()
    inner = client.prefill

    async def prefill(inputs):
        while not arrived.is_set():
            if len(core.requests) == num_requests:
                arrived.set()
            await asyncio.sleep(0.01)
        return await inner(inputs)

    monkeypatch.setattr(client, "prefill", prefill)


def run_all(client: GenerationClient, speculate: bool) -> tuple[dict, dict]:
    """Every prompt at once: the tokens of each, and the status of each that failed."""
    return generate_all(client, PROMPTS, greedy(MAX_NEW), disable_speculation=not speculate)


@pytest.mark.parametrize("speculate", [True, False], ids=["draft-bound", "target-bound"])
def test_router_never_sends_a_replica_more_than_it_holds(
    small, monkeypatch: pytest.MonkeyPatch, speculate: bool
) -> None:
    """Ten requests, all queued before the first round: a speculating request needs a place
    in both services (3 at a time), a plain one only in the target (4)."""
    target = watch(monkeypatch, small.target, lambda rt: rt.num_requests)
    draft = watch(monkeypatch, small.draft, lambda rt: len(rt.live))
    hold_first_prefill(monkeypatch, small.router.core, len(PROMPTS))
    outputs, errors = run_all(small.client, speculate)
    assert errors == {}
    assert outputs == {k: small.expected(p) for k, p in enumerate(PROMPTS)}
    assert target["codes"] == {0} and draft["codes"] <= {0}  # nothing refused or failed
    limit = DRAFT_MAX if speculate else TARGET_MAX
    assert target["held"] == limit and target["batch"] <= limit  # full, never over
    assert draft["held"] == (DRAFT_MAX if speculate else 0)
    for servicer, kind in ((small.target, "target"), (small.draft, "draft")):
        address = f"127.0.0.1:{servicer.host.port}"
        assert wait_until(lambda a=address, k=kind: is_empty(occupancy(a, k)), 20)
