"""The router as an SMG worker (smg.worker.v1, docs/smg.md), driven by clients generated from
SMG's protos through a real router on loopback over a tiny target and its EAGLE-3 draft: health
from STARTING (its target not up yet) to SERVING to DRAINING, output equal to the Generation
service's, streamed deltas, abort and what the services hold after, refusals, identity,
capabilities and topology."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.cluster import free_port
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.router_config import RouterConfig
from specmesh.router.server import RouterService, RouterSettings
from specmesh.rpc.inline_steps import InlineSteps
from specmesh.smg import worker_control_pb2 as control_pb2
from specmesh.smg import worker_control_pb2_grpc as control_grpc
from specmesh.smg import worker_inference_pb2 as smg_pb2
from specmesh.smg import worker_inference_pb2_grpc as smg_grpc
from specmesh.target_service.runtime import TargetRuntime

States = control_pb2.WorkerHealthState
PROMPTS = [[1, 5, 9, 23, 42], [7, 7, 3, 100, 64, 12, 8]]


class Clients(SimpleNamespace):
    """smg.worker.v1 stubs on one router's port."""

    @classmethod
    def open(cls, port: int) -> Clients:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return cls(
            channel=channel,
            inference=smg_grpc.WorkerInferenceStub(channel),
            control=control_grpc.WorkerControlStub(channel),
        )

    def health(self, components: bool = False) -> control_pb2.GetHealthResponse:
        return self.control.GetHealth(control_pb2.GetHealthRequest(include_components=components))


def _request(prompt: list[int], rid: str = "", stream: bool = True, **sampling):
    return smg_pb2.GenerateRequest(
        request_id=rid,
        tokenized=smg_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=smg_pb2.SamplingParams(**sampling),
        stream=stream,
    )


def _greedy(n: int, **more) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **more}


async def _in_loop(make, *args):
    return make(*args)


@pytest.fixture(scope="module")
def worker(tiny_dir: Path):
    """A draft, then a router whose target is not up yet (what it answers then is kept in
    ``early``), then the target on the port the router dials."""
    target_dir, draft_dir = str(tiny_dir / "target"), str(tiny_dir / "draft")
    loop = LoopThread()
    draft = loop.run(serve_draft(load_draft(DraftConfig("eagle3", draft_dir, target_dir, SPEC))))
    target_port = free_port()
    settings = RouterSettings(
        (f"127.0.0.1:{target_port}",), (f"127.0.0.1:{draft.host.port}",), "127.0.0.1:0",
        RouterConfig(draft_cooldown_s=0.2), tokenizer=target_dir,
    )  # fmt: skip
    router = loop.run(_in_loop(RouterService, settings))  # grpc.aio binds the running loop
    starting = asyncio.run_coroutine_threadsafe(router.start(), loop.loop)
    assert wait_until(lambda: router.port, 30)
    smg = Clients.open(router.port)
    early = SimpleNamespace(health=smg.health(), capabilities=None, generate=None)
    for name, call in (
        ("capabilities", lambda: smg.control.GetCapabilities(control_pb2.GetCapabilitiesRequest())),
        ("generate", lambda: list(smg.inference.Generate(_request(PROMPTS[0]), timeout=10))),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        setattr(early, name, e.value.code())
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir)), port=target_port))
    starting.result(120)
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield SimpleNamespace(
        loop=loop, router=router, target=target, draft=draft, smg=smg, client=client, early=early,
        target_dir=target_dir,
    )  # fmt: skip
    client.close()
    smg.channel.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _run(smg: Clients, request) -> tuple[list[int], list, smg_pb2.GenerateComplete]:
    """Streamed token ids, the chunks, and the GenerateComplete (which must come last)."""
    responses = list(smg.inference.Generate(request, timeout=60))
    *chunks, last = responses
    assert last.WhichOneof("response") == "complete"
    assert all(r.WhichOneof("response") == "chunk" for r in chunks)
    return [t for r in chunks for t in r.chunk.token_ids], [r.chunk for r in chunks], last.complete


def test_health_is_starting_until_the_target_answers_then_serving(worker) -> None:
    assert worker.early.health.state == States.WORKER_HEALTH_STATE_STARTING
    assert worker.early.capabilities == grpc.StatusCode.UNAVAILABLE
    assert worker.early.generate == grpc.StatusCode.UNAVAILABLE
    health = worker.smg.health(components=True)
    assert health.state == States.WORKER_HEALTH_STATE_SERVING, health.message
    assert health.checked_at.seconds > 0
    assert sorted(c.component_id.split("@")[0] for c in health.components) == [
        "draft-0",
        "target-0",
    ]
    assert {c.state for c in health.components} == {States.WORKER_HEALTH_STATE_SERVING}


def test_greedy_output_is_the_generation_services(worker, oracle) -> None:
    for prompt in PROMPTS:
        expected = collect(worker.client.generate(prompt_token_ids=prompt, sampling=greedy(16)))[0]
        streamed, chunks, done = _run(worker.smg, _request(prompt, **_greedy(16)))
        assert streamed == list(done.output_ids) == expected
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
            "length", len(prompt), 16
        )  # fmt: skip
        totals = [c.completion_tokens for c in chunks]
        assert totals == [
            sum(len(c.token_ids) for c in chunks[: i + 1]) for i in range(len(chunks))
        ]
        assert all(c.prompt_tokens == len(prompt) and c.index == 0 for c in chunks)
    assert expected == oracle(worker.target_dir, PROMPTS[-1], 16)


def test_without_stream_one_complete_is_sent(worker) -> None:
    responses = list(
        worker.smg.inference.Generate(_request(PROMPTS[0], stream=False, **_greedy(8)))
    )
    assert [r.WhichOneof("response") for r in responses] == ["complete"]
    expected = collect(worker.client.generate(prompt_token_ids=PROMPTS[0], sampling=greedy(8)))[0]
    assert list(responses[0].complete.output_ids) == expected


def test_seeded_sampling_and_logprobs_match_the_generation_services(worker) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    calls = worker.client.generate(prompt_token_ids=PROMPTS[1], sampling=params)
    expected = [
        (t, lp.logprob) for r in calls for t, lp in zip(r.token_ids, r.logprobs, strict=True)
    ]
    request = _request(
        PROMPTS[1], temperature=0.8, sampling_seed=7, max_new_tokens=12, ignore_eos=True
    )
    request.return_logprob, request.top_logprobs_num = True, 2
    streamed, _, done = _run(worker.smg, request)
    lps = done.output_logprobs
    assert streamed == list(lps.token_ids) == [t for t, _ in expected]
    assert list(lps.token_logprobs) == pytest.approx([v for _, v in expected])
    assert all(len(top.token_ids) == 2 for top in lps.top_logprobs)


def test_a_stop_token_ends_with_matched_token_id(worker) -> None:
    free = collect(worker.client.generate(prompt_token_ids=PROMPTS[0], sampling=greedy(16)))[0]
    stop = free[5]
    streamed, _, done = _run(worker.smg, _request(PROMPTS[0], **_greedy(16, stop_token_ids=[stop])))
    assert streamed == free[: free.index(stop) + 1]
    assert done.finish_reason == "stop" and done.matched_token_id == stop


@contextlib.contextmanager
def slowed(servicer, seconds: float):
    """Every Step batch of ``servicer`` takes ``seconds`` longer, on its worker thread (the
    event loop, which the router shares here, stays free)."""
    inner, inline = servicer.run_batch, servicer.inline
    servicer.inline = InlineSteps(max_ms=0)

    def run_batch(*args):
        time.sleep(seconds)
        return inner(*args)

    servicer.run_batch = run_batch
    try:
        yield
    finally:
        servicer.run_batch, servicer.inline = inner, inline


def test_abort_ends_the_stream_and_the_services_hold_nothing(worker) -> None:
    smg = worker.smg
    with slowed(worker.target, 0.05):
        call = smg.inference.Generate(_request(PROMPTS[0], "smg-abort", **_greedy(200)), timeout=60)
        first = next(call)
        assert first.WhichOneof("response") == "chunk" and first.request_id == "smg-abort"
        with pytest.raises(grpc.RpcError) as e:  # its id is taken while it runs
            list(smg.inference.Generate(_request(PROMPTS[1], "smg-abort", **_greedy(4))))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        answer = smg.inference.Abort(smg_pb2.AbortRequest(request_id="smg-abort", reason="test"))
        assert answer.success
        rest = list(call)
    done = rest[-1].complete
    assert done.finish_reason == "abort" and len(done.output_ids) < 200
    assert list(done.output_ids[: len(first.chunk.token_ids)]) == list(first.chunk.token_ids)
    again = smg.inference.Abort(smg_pb2.AbortRequest(request_id="smg-abort"))
    assert again.success and "not running" in again.message  # idempotent
    for servicer, kind in ((worker.target, "target"), (worker.draft, "draft")):
        address = f"127.0.0.1:{servicer.host.port}"
        assert wait_until(lambda a=address, k=kind: is_empty(occupancy(a, k)), 30), kind
    assert not worker.router.core.slots


@pytest.mark.parametrize(
    ("sampling", "code"),
    [
        ({"n": 2}, grpc.StatusCode.UNIMPLEMENTED),
        ({"ebnf_grammar": "root ::= 'a'"}, grpc.StatusCode.UNIMPLEMENTED),
        ({"logit_bias": {"x": 1.0}}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"max_new_tokens": 1 << 20}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_refusals(worker, sampling: dict, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(worker.smg.inference.Generate(_request(PROMPTS[0], **sampling), timeout=10))
    assert e.value.code() == code, e.value.details()


def test_an_empty_prompt_is_refused(worker) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(worker.smg.inference.Generate(_request([]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_identity_capabilities_and_topology(worker) -> None:
    control, port = worker.smg.control, worker.router.port
    identity = control.GetIdentity(control_pb2.GetIdentityRequest()).identity
    assert identity.worker_id.endswith(f":{port}") and identity.instance_id and identity.version
    assert identity.started_at.seconds > 0 and identity.labels["engine"] == "specmesh"
    caps = control.GetCapabilities(control_pb2.GetCapabilitiesRequest()).capabilities
    assert (caps.api_major, caps.api_minor) == (1, 0)
    assert {"generate", "abort", "token_id_streaming", "speculative_decoding"} <= set(caps.features)
    (engine,) = caps.engines
    assert engine.engine_type == "specmesh" and list(engine.model_ids) == ["target"]
    assert caps.attributes["draft_kind"] == "eagle3"
    assert caps.attributes["num_draft_tokens"] == str(SPEC.num_draft_tokens)
    assert caps.max_concurrent_requests > 0
    topology = control.GetTopology(control_pb2.GetTopologyRequest()).topology
    assert topology.worker_id == identity.worker_id
    ends = {e.engine_id: e for e in topology.engines}
    assert ends["target-0"].endpoint == f"grpc://127.0.0.1:{worker.target.host.port}"
    assert ends["draft-0"].attributes["draft_kind"] == "eagle3"
    again = control.GetTopology(control_pb2.GetTopologyRequest()).topology
    assert again.topology_version == topology.topology_version != 0


def test_draining_after_stop_begins(worker) -> None:
    """A second router on the same services: stopping it drains a running request (DRAINING,
    new requests UNAVAILABLE) before it closes."""
    loop = worker.loop
    router = loop.run(serve_router(worker.target, worker.draft))
    smg, stopping = Clients.open(router.port), None
    try:
        request = _request(PROMPTS[0], **_greedy(60))
        request.sampling_params.engine_parameters.update({"disable_speculation": True})
        with slowed(worker.target, 0.05):
            call = smg.inference.Generate(request, timeout=60)
            assert next(call).WhichOneof("response") == "chunk"
            stopping = asyncio.run_coroutine_threadsafe(router.stop(30), loop.loop)
            assert wait_until(lambda: smg.health().state == States.WORKER_HEALTH_STATE_DRAINING, 10)
            with pytest.raises(grpc.RpcError) as e:
                list(smg.inference.Generate(_request(PROMPTS[1], **_greedy(4)), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(call)
        assert rest[-1].complete.finish_reason == "length"
        assert len(rest[-1].complete.output_ids) == 60
        stopping.result(60)
    finally:
        smg.channel.close()
        if stopping is None:
            loop.run(router.stop(0.5))
