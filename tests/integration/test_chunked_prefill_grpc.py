"""Chunked prefill over real gRPC services: the router sends long prompts in pieces of 7 tokens;
output and prompt logprobs equal transformers', and a client that cancels in the middle of a
prompt's pieces leaves nothing in the target or the draft (asked through GetInfo). A target
replica stopped hard in the middle of a burst's pieces costs nothing: every request is replayed
on the other one, exact (issue 33 item 1)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from conftest import assert_accepted, assert_speculated
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    generate_all,
    greedy,
    num_accepted,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.protocol.errors import ServiceDownError
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.router_config import RouterConfig
from specmesh.router.server import RouterService, RouterSettings
from specmesh.router.step_stream import StepStream
from specmesh.target_service.runtime import TargetRuntime

LONG = list(range(10, 50))
PROMPTS = [LONG, [11, 12, 13], list(range(100, 120)), [7] * 9]


@pytest.fixture(scope="module")
def chunked(copy_dir: Path, oracle):
    """Target, EAGLE-3 draft and a router with a prefill budget of 7 tokens per round; the draft
    predicts its target (`copy_drafts`), so rounds accept draft tokens."""
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir))))
    draft = loop.run(serve_draft(load_draft(DraftConfig("eagle3", draft_dir, target_dir, SPEC))))
    router = loop.run(serve_router(target, draft, prefill_chunk_tokens=7, max_batch_size=3))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield SimpleNamespace(
        loop=loop, target=target, draft=draft, router=router, client=client,
        expected=lambda prompt, n: oracle(target_dir, prompt, n), target_dir=target_dir,
    )  # fmt: skip
    client.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _address(servicer) -> str:
    return f"127.0.0.1:{servicer.host.port}"


def test_concurrent_requests_equal_transformers_greedy(chunked) -> None:
    results: dict[int, list[int]] = {}
    stats: dict[int, object] = {}

    def run(k: int) -> None:
        call = chunked.client.generate(prompt_token_ids=PROMPTS[k], sampling=greedy(10), timeout=60)
        results[k], _, last = collect(call)
        stats[k] = last.stats

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, prompt in enumerate(PROMPTS):
        assert results[k] == chunked.expected(prompt, 10)
    assert_speculated(stats.values())
    assert_accepted(stats.values(), min_tokens=len(PROMPTS))


def test_prompt_logprobs_cover_every_piece(chunked) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=2)
    responses = list(chunked.client.generate(prompt_token_ids=LONG, sampling=params, timeout=60))
    ids, _, _ = collect(responses)
    assert ids == chunked.expected(LONG, 4)
    hf = AutoModelForCausalLM.from_pretrained(chunked.target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([LONG])).logits[0].float(), -1)
    entries = responses[0].prompt_logprobs
    assert [e.token_id for e in entries] == LONG[1:]
    for t, e in enumerate(entries, start=1):
        assert e.logprob == pytest.approx(raw[t - 1, LONG[t]].item(), abs=1e-4)
        assert [x.token_id for x in e.top] == raw[t - 1].topk(2).indices.tolist()


def test_cancel_in_the_middle_of_the_pieces_frees_both_services(chunked) -> None:
    """The router's target client is wrapped to hold the prompt's third piece until the client
    has cancelled; then both services are asked what they hold."""
    core = chunked.router.core
    target = core.targets[0]
    inner, reached, cancelled = target.prefill, threading.Event(), threading.Event()

    async def prefill(inputs):
        out = await inner(inputs)
        if any(i.input_start == 14 for i in inputs):
            reached.set()
            while not cancelled.is_set():  # the request is mid-prefill: pieces 1-3 are held
                await asyncio.sleep(0.01)
        return out

    target.prefill = prefill
    try:
        call = chunked.client.generate(prompt_token_ids=LONG, sampling=greedy(50), timeout=60)
        consumer = threading.Thread(target=lambda: _drain(call))
        consumer.start()
        assert reached.wait(30)
        assert occupancy(_address(chunked.target), "target").num_requests == 1
        call.cancel()
        consumer.join(30)
        assert wait_until(lambda: not core.requests, 20)  # the router saw the cancel
    finally:
        cancelled.set()
        target.prefill = inner
    for servicer, kind in ((chunked.target, "target"), (chunked.draft, "draft")):
        assert wait_until(lambda s=servicer, k=kind: is_empty(occupancy(_address(s), k)), 20)
    after = collect(chunked.client.generate(prompt_token_ids=[8, 9], sampling=greedy(4)))[0]
    assert after == chunked.expected([8, 9], 4)


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED


# -- a target replica lost in the middle of a burst's pieces (issue 33 item 1) ------------------
# 40 to 61 tokens against a budget of 32 per round: a request's last piece shares its round with
# the next request's first piece, which went to the other target (least loaded at admission).
BURST = [[(7 * k + 3 * t) % 300 + 10 for t in range(40 + 3 * k)] for k in range(8)]
BURST_NEW = 12


async def _router(targets: list, draft, cfg: RouterConfig) -> RouterService:
    addresses = tuple(_address(t) for t in targets)
    tokenizer = targets[0].runtime.cfg.model_dir
    router = RouterService(
        RouterSettings(addresses, (_address(draft),), "127.0.0.1:0", cfg, tokenizer=tokenizer)
    )
    await router.start()
    return router


def _stop_at_a_later_piece(core, servicer) -> threading.Event:
    """Once the whole burst waits in the router's queue, stop ``servicer`` (target 0) hard as
    the router sends it a piece after a prompt's first; the event says it happened."""
    client, arrived, stopped = core.targets[0], asyncio.Event(), threading.Event()
    inner = client.prefill

    async def prefill(inputs):
        while not arrived.is_set():  # one-shot: the whole burst is queued before any round
            if len(core.requests) == len(BURST):
                arrived.set()
            await asyncio.sleep(0.01)
        if not stopped.is_set() and any(i.input_start > 0 for i in inputs):
            stopped.set()
            await servicer.host.server.stop(None)  # no grace: its calls end at once
        return await inner(inputs)

    client.prefill = prefill
    return stopped


def _run_burst(client: GenerationClient) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every BURST prompt at once: the tokens of each, and the status of each that failed."""
    return generate_all(client, BURST, greedy(BURST_NEW))


def test_target_stopped_mid_prefill_replays_every_request_exactly(copy_dir: Path, oracle) -> None:
    """Two targets, one micro-batch. Target 0 stops while the router sends it a later piece
    of a prompt: that prefill fails while the same round's piece on target 1 runs. Its requests
    are replayed on target 1; none fails (the round once failed the healthy target's requests
    with INTERNAL: an AttributeError on a request that failover had unpinned), every output is
    transformers', with draft tokens accepted (`copy_drafts`), and target 1 and the draft hold
    nothing after."""
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    loop = LoopThread()
    targets = [loop.run(serve_target(TargetRuntime(TargetConfig(target_dir)))) for _ in range(2)]
    draft = loop.run(serve_draft(load_draft(DraftConfig("eagle3", draft_dir, target_dir, SPEC))))
    cfg = RouterConfig(prefill_chunk_tokens=32, num_micro_batches=1, draft_cooldown_s=0.2)
    router = loop.run(_router(targets, draft, cfg))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    try:
        stopped = _stop_at_a_later_piece(router.core, targets[0])
        accepted = num_accepted()
        outputs, errors = _run_burst(client)
        assert stopped.is_set() and errors == {}
        assert num_accepted() > accepted, "no draft token was accepted"
        assert outputs == {k: oracle(target_dir, p, BURST_NEW) for k, p in enumerate(BURST)}
        core = router.core
        assert core.num_live_targets == 1 and sum(r.load for r in core.replicas.all) == 0
        for servicer, kind in ((targets[1], "target"), (draft, "draft")):
            assert wait_until(lambda s=servicer, k=kind: is_empty(occupancy(_address(s), k)), 20)
    finally:
        client.close()
        loop.run(router.stop(0.5))
        for servicer in (targets[1], draft):
            loop.run(servicer.host.shutdown(0.5))
        loop.close()


class _CutCall:
    """A Step call whose connection died under the write: gRPC core's INTERNAL, as a write
    racing a killed service gets it."""

    async def write(self, _msg) -> None:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details="Internal error from Core")

    async def read(self):
        await asyncio.Event().wait()  # no answer ever comes

    def cancel(self) -> None:
        pass


def test_a_write_cut_by_a_dead_service_is_service_down() -> None:
    """Such a write is the replica going down (its requests are replayed), never INTERNAL."""

    async def scenario() -> None:
        stream = StepStream(_CutCall, "target-0", timeout_s=None)
        with pytest.raises(ServiceDownError, match="target-0: the stream broke under a write"):
            await stream.request([SimpleNamespace()])
        await stream.close()

    asyncio.run(scenario())
