"""Balanced admission (`RouterCore._share`): over a remote (gRPC) target, a burst of requests is
split between the micro-batches, so the target verifies one while the draft works on the other;
in process (one device runs both) one micro-batch takes them all, as before. In process there is
one micro-batch by default, so a request arriving while another runs joins its batch. Output
equals transformers' every way, and the target holds nothing afterwards.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpc_harness import LoopThread, serve_target
from procs import is_empty

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.grpc_clients import GrpcTargetClient
from specmesh.router.in_process import InProcessTarget
from specmesh.router.request import Request
from specmesh.router.round import RoundRunner
from specmesh.router.router_config import RouterConfig
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5 + i, 6, 7, 8, 9] for i in range(8)]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def target(tiny_dir: Path, oracle):
    loop = LoopThread()
    model_dir = str(tiny_dir / "target")
    servicer = loop.run(serve_target(TargetRuntime(TargetConfig(model_dir))))
    yield SimpleNamespace(
        loop=loop,
        servicer=servicer,
        model_dir=model_dir,
        expected=[oracle(model_dir, p, NEW_TOKENS) for p in PROMPTS],
    )
    loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _round_sizes(monkeypatch) -> list[int]:
    """The number of requests each decode round of a micro-batch carries, from now on."""
    sizes: list[int] = []
    step = RoundRunner.step

    async def counted(self, slots):
        sizes.append(len(slots))
        await step(self, slots)

    monkeypatch.setattr(RoundRunner, "step", counted)
    return sizes


def _burst(target, client_of, monkeypatch, **cfg) -> tuple[list[list[int]], list[int]]:
    """Eight requests at once through a router core over ``client_of()``: their tokens, and
    the number of requests each decode round of a micro-batch carried; the gRPC target must
    hold nothing once they ended."""
    sizes = _round_sizes(monkeypatch)

    async def main():
        client = client_of()
        if isinstance(client, GrpcTargetClient):
            await client.connect()
        core = RouterCore([client], [], RouterConfig(num_micro_batches=2, **cfg))
        await core.start()
        try:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
            reqs = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
            outputs = await asyncio.gather(*(_tokens(core, r) for r in reqs))
            return outputs, await _emptied(target.servicer)
        finally:
            await core.stop()
            if isinstance(client, GrpcTargetClient):
                await client.close()

    outputs, emptied = target.loop.run(main())
    assert emptied
    return outputs, sizes


async def _tokens(core: RouterCore, req: Request) -> list[int]:
    return [t async for chunk in core.generate(req) for t in chunk.token_ids]


async def _emptied(servicer, timeout_s: float = 10.0) -> bool:
    """Whether the gRPC target holds nothing within ``timeout_s``, asked while the router's
    stream is open (releases are in-band; closing the stream would free everything anyway)."""
    deadline = time.monotonic() + timeout_s
    while not is_empty(servicer.info(servicer.runtime).occupancy):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _grpc(target):
    return lambda: GrpcTargetClient(f"127.0.0.1:{target.servicer.host.port}")


def test_a_burst_is_split_between_micro_batches_over_grpc(target, monkeypatch) -> None:
    outputs, sizes = _burst(target, _grpc(target), monkeypatch)
    assert outputs == target.expected
    assert max(sizes) == 4  # eight requests, two micro-batches: four each


def test_unbalanced_admission_lets_one_micro_batch_take_the_burst(target, monkeypatch) -> None:
    outputs, sizes = _burst(target, _grpc(target), monkeypatch, balance_micro_batches=False)
    assert outputs == target.expected
    assert max(sizes) > 4


def test_in_process_one_micro_batch_takes_the_burst(target, monkeypatch) -> None:
    """In process the target and draft share a device: one full micro-batch is best, and the
    default (balance where a target is remote) keeps it."""
    runtime = TargetRuntime(TargetConfig(target.model_dir))
    outputs, sizes = _burst(target, lambda: InProcessTarget(runtime), monkeypatch)
    assert outputs == target.expected
    assert max(sizes) > 4


def _staggered(target, monkeypatch, cfg: RouterConfig) -> tuple[list[list[int]], list[int], int]:
    """In process: a long request, then a short one sent once the first has streamed a token
    (as under sustained load); their tokens, the requests each round carried and the core's
    number of micro-batches."""
    sizes = _round_sizes(monkeypatch)
    runtime = TargetRuntime(TargetConfig(target.model_dir))

    async def main():
        core = RouterCore([InProcessTarget(runtime)], [], cfg)
        await core.start()
        try:
            first = Request(
                "long", PROMPTS[0], SamplingParams(max_new_tokens=4 * NEW_TOKENS, ignore_eos=True)
            )
            later = Request(
                "short", PROMPTS[1], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
            )
            stream, tokens = core.generate(first), []
            tokens += (await anext(stream)).token_ids
            running = asyncio.ensure_future(_tokens(core, later))
            tokens += [t async for chunk in stream for t in chunk.token_ids]
            return [tokens, await running], core.num_micro_batches
        finally:
            await core.stop()

    outputs, workers = target.loop.run(main())
    return outputs, sizes, workers


def test_in_process_an_arrival_joins_the_running_micro_batch(target, oracle, monkeypatch) -> None:
    """The in-process default is one micro-batch: a second worker would take the arrival into a
    batch of its own (two half-size steps on one device; bench_results/HISTORY.md, sustained load)."""
    outputs, sizes, workers = _staggered(target, monkeypatch, RouterConfig())
    assert workers == 1
    assert outputs == [oracle(target.model_dir, PROMPTS[0], 4 * NEW_TOKENS), target.expected[1]]
    assert max(sizes) == 2  # the short request ran in the long one's rounds


def test_micro_batches_default_to_two_over_grpc(target) -> None:
    async def main():
        client = _grpc(target)()
        await client.connect()
        try:
            return RouterCore([client], [], RouterConfig()).num_micro_batches
        finally:
            await client.close()

    assert target.loop.run(main()) == 2
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        RouterConfig(num_micro_batches=0)
