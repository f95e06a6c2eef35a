"""Every limit refuses a hostile request before it costs anything (DESIGN.md §3 "Limits"):
through the real servers, each violation gets its precise status naming the limit and the
numbers, fast; a huge refused request leaves memory where it was; health checks keep answering
while a long (allowed) prompt is tokenized; and the services serve exactly afterwards.

Response times and RSS deltas are printed (``pytest -s``); the bounds asserted are generous on
purpose (they catch a frozen loop or a decoded bomb, not a slow machine)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import grpc
import pytest
import torch
from conftest import rss_mb
from grpc_harness import collect, greedy, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.client import GenerationClient
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.limits import RouterLimits
from specmesh.router.server import RouterService, RouterSettings
from specmesh.runtime.codec import split_hidden_states
from specmesh.v1 import draft_pb2, draft_pb2_grpc, generation_pb2

CODE = grpc.StatusCode
FAST_S = 5.0  # generous: a refusal is answered in milliseconds
MAX_RSS_GROWTH_MB = 200


def refused(call) -> tuple[grpc.RpcError, float]:
    """Run a call that must fail; its error and how long the answer took."""
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as e:
        collect(call())
    return e.value, time.perf_counter() - start


def assert_refused(call, code: grpc.StatusCode, *needles: str) -> float:
    err, elapsed = refused(call)
    assert err.code() == code, err.details()
    for needle in needles:
        assert needle in err.details(), err.details()
    assert elapsed < FAST_S
    return elapsed


# -- router: one call per limit ---------------------------------------------------------------
def _stop(**kw: object) -> dict:
    return {"prompt_token_ids": [5, 6], "sampling": generation_pb2.SamplingParams(**kw)}


CASES = {  # name: (request kwargs, status, what the message names)
    "prompt-bytes": (
        {"prompt": "é" * 600_000},
        CODE.INVALID_ARGUMENT,
        ["1200000 bytes", "1048576", "--max-prompt-bytes"],
    ),
    "prompt-token-ids": (
        {"prompt_token_ids": [5] * 100_000},
        CODE.INVALID_ARGUMENT,
        ["100000 tokens", "max_context_len"],
    ),
    "stop-strings": (_stop(stop=["x"] * 33), CODE.INVALID_ARGUMENT, ["33 stop strings", "32"]),
    "stop-string-len": (
        _stop(stop=["ok", "y" * 257]),
        CODE.INVALID_ARGUMENT,
        ["257 characters", "256", "--max-stop-string-len"],
    ),
    "empty-stop-string": (_stop(stop=["ok", ""]), CODE.INVALID_ARGUMENT, ["empty stop string"]),
    "stop-token-ids": (
        _stop(stop_token_ids=list(range(65))),
        CODE.INVALID_ARGUMENT,
        ["65 stop_token_ids", "64", "--max-stop-token-ids"],
    ),
    "stop-token-oov": (
        _stop(stop_token_ids=[7, 320, 10**6]),
        CODE.INVALID_ARGUMENT,
        ["outside vocab [0, 320)", "[320, 1000000]"],
    ),
    "request-id": (
        {"prompt_token_ids": [5], "request_id": "r" * 300},
        CODE.INVALID_ARGUMENT,
        ["300 characters", "256", "--max-request-id-len"],
    ),
    "image-count": (
        {"prompt_token_ids": [5], "images": [b"\x89PNG"] * 9},
        CODE.INVALID_ARGUMENT,
        ["9 images", "limit of 8", "--max-images-per-request"],
    ),
    "image-bytes": (
        {"prompt_token_ids": [5], "images": [b"\x89PNG", bytes(11 << 20)]},
        CODE.INVALID_ARGUMENT,
        ["image 1 of 11534336 bytes", "10485760", "--max-image-bytes"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_router_limit_is_its_precise_status(stack, case: str) -> None:
    kwargs, code, needles = CASES[case]
    elapsed = assert_refused(lambda: stack.client.generate(**kwargs), code, *needles)
    print(f"\n{case}: refused in {elapsed * 1000:.1f} ms")


def test_two_million_stop_strings_are_refused_without_scanning(stack) -> None:
    sampling = generation_pb2.SamplingParams(stop=["a"] * 2_000_000)
    elapsed = assert_refused(
        lambda: stack.client.generate(prompt_token_ids=[5], sampling=sampling),
        CODE.INVALID_ARGUMENT,
        "2000000 stop strings",
        "--max-stop-strings",
    )
    print(f"\n2M stop strings: refused in {elapsed * 1000:.1f} ms (client send included)")


def test_huge_prompt_is_refused_before_tokenizing_and_memory_stays(stack) -> None:
    prompt = "def f(x):\n    return x\n" * (30_000_000 // 24)  # 30 MB
    gc.collect()
    before = rss_mb()
    elapsed = assert_refused(
        lambda: stack.client.generate(prompt=prompt), CODE.INVALID_ARGUMENT, "--max-prompt-bytes"
    )
    gc.collect()
    growth = rss_mb() - before
    print(f"\n30 MB prompt: refused in {elapsed * 1000:.0f} ms, RSS {growth:+.0f} MB")
    assert growth < MAX_RSS_GROWTH_MB


def test_malformed_request_bytes_are_invalid_argument(stack) -> None:
    address = f"127.0.0.1:{stack.router.port}"
    with grpc.insecure_channel(address) as channel:
        raw = lambda method, kind: getattr(channel, kind)(
            f"/specmesh.v1.Generation/{method}", request_serializer=lambda b: b
        )
        for method, kind in (("Generate", "unary_stream"), ("GetInfo", "unary_unary")):
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as e:
                out = raw(method, kind)(b"\xff\xff\xff\xff", timeout=10)
                list(out) if kind == "unary_stream" else out
            assert e.value.code() == CODE.INVALID_ARGUMENT, e.value.details()
            assert "does not parse" in e.value.details()
            print(f"\nmalformed {method}: {(time.perf_counter() - start) * 1000:.1f} ms")
        good = generation_pb2.GenerateRequest(
            prompt_token_ids=[5, 6], sampling={"max_new_tokens": 2}
        )
        replies = list(raw("Generate", "unary_stream")(good.SerializeToString(), timeout=30))
        assert replies and replies[-1]  # the same raw channel is served once the bytes parse


class HeldTokenizer:
    """The router's tokenizer with ``encode`` held until ``release`` is set: a prompt stays "being
    tokenized" for as long as a test needs, on a machine of any speed."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.started, self.release = inner, threading.Event(), threading.Event()

    def encode(self, *args: object, **kwargs: object) -> list[int]:
        self.started.set()
        self.release.wait(10)  # bounded: a loop that blocks on this fails its health checks
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_health_answers_while_a_long_prompt_is_tokenized(
    stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 MiB prompt (the default limit) is held in the tokenizer, then tokenized (about a
    second for the tiny tokenizer) and refused for its token count; health checks answer while
    it is held (so whatever the machine's speed) and keep answering until the refusal."""
    prompt = "for i in range(10):\n    print(i)\n" * ((1 << 20) // 34)
    held = HeldTokenizer(stack.router.servicer.tokenizer)
    monkeypatch.setattr(stack.router.servicer, "tokenizer", held)
    done = threading.Event()
    outcome: dict = {}

    def generate() -> None:
        outcome["start"] = time.perf_counter()
        outcome["error"], _ = refused(lambda: stack.client.generate(prompt=prompt))
        outcome["end"] = time.perf_counter()
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    latencies: list[float] = []
    with grpc.insecure_channel(f"127.0.0.1:{stack.router.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="specmesh.v1.Generation")

        def check() -> None:
            t = time.perf_counter()
            status = health.Check(request, timeout=5).status
            latencies.append(time.perf_counter() - t)
            assert status == health_pb2.HealthCheckResponse.SERVING

        try:
            assert held.started.wait(30)  # the prompt is in the tokenizer now
            for _ in range(3):
                check()
            assert not done.is_set()  # answered while the prompt was still being tokenized
        finally:
            held.release.set()
        while not done.is_set():
            check()
            time.sleep(0.01)
    worker.join()
    err, start, end = outcome["error"], outcome["start"], outcome["end"]
    assert err.code() == CODE.INVALID_ARGUMENT and "tokens exceeds" in err.details()
    print(
        f"\n1 MiB prompt held, tokenized and refused in {end - start:.2f} s; {len(latencies)} "
        f"health checks answered meanwhile, slowest {max(latencies) * 1000:.0f} ms"
    )
    assert max(latencies) < 1.0


def test_full_tokenizer_queue_is_resource_exhausted(stack) -> None:
    """One prompt tokenizing and one queue slot: the next text prompt is refused at once."""
    limits = RouterLimits(max_queued_prompts=1, tokenizer_threads=1)
    router = stack.loop.run(_router(stack, limits))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            long = client.generate(prompt="x = 1\n" * ((1 << 20) // 6))
            threading.Thread(target=lambda: refused(lambda: long), daemon=True).start()
            assert wait_until(lambda: router.servicer.prompts.queued == 1, 30)
            elapsed = assert_refused(
                lambda: client.generate(prompt="x = 1"),
                CODE.RESOURCE_EXHAUSTED,
                "1 prompts are already being tokenized",
                "--max-queued-prompts",
            )
            print(f"\nfull tokenizer queue: refused in {elapsed * 1000:.1f} ms")
            assert wait_until(lambda: router.servicer.prompts.queued == 0, 30)
            ids, _, last = collect(client.generate(prompt="x = 1", sampling=greedy(3)))
            assert len(ids) == 3 and last.finish_reason == "length"
    finally:
        stack.loop.run(router.stop(0.5))


async def _router(stack, limits: RouterLimits) -> RouterService:
    addr = lambda s: (f"127.0.0.1:{s.host.port}",)
    settings = RouterSettings(
        addr(stack.target), addr(stack.draft), "127.0.0.1:0",
        tokenizer=stack.dirs.target, limits=limits,
    )  # fmt: skip
    service = RouterService(settings)
    await service.start()
    return service


# -- draft: feature dtype and values ----------------------------------------------------------
def _extend(rows: dict[str, list[int]], feats: torch.Tensor) -> draft_pb2.DraftStepRequest:
    (states,) = split_hidden_states([len(ids) for ids in rows.values()], {"aux_hidden": feats})
    requests = [
        draft_pb2.ExtendRequest(request_id=rid, token_ids=ids, next_token_id=9, starts_request=True)
        for rid, ids in rows.items()
    ]
    batch = draft_pb2.ExtendBatch(requests=requests, states=states, propose_after=True)
    return draft_pb2.DraftStepRequest(extend=batch)


def test_draft_refuses_feature_dtypes_and_non_finite_values(stack) -> None:
    width = 3 * stack.target.runtime.model_config.hidden_size
    rows = {"a": [5, 6, 7], "b": [8, 9]}
    feats = torch.randn(5, width)
    nan, inf = feats.clone(), feats.clone()
    nan[3, 7] = float("nan")  # a row of "b"
    inf[0, 0] = float("inf")  # a row of "a"
    batches = [
        _extend(rows, feats.to(torch.int32)),
        _extend(rows, feats.to(torch.bfloat16)),  # the target is fp32
        _extend(rows, nan),
        _extend(rows, inf),
        _extend({"c": [5, 6, 7], "d": [8, 9]}, feats),  # good: the stream serves on
    ]
    for i, b in enumerate(batches):
        b.batch_id = i + 1
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.host.port}") as channel:
        start = time.perf_counter()
        out = list(draft_pb2_grpc.DraftStub(channel).Step(iter(batches), timeout=30))
        elapsed = time.perf_counter() - start
    messages = [o.status.message for o in out]
    assert [o.status.code for o in out] == [3, 3, 3, 3, 0], messages
    assert "dtype int32, expected the target's fp32" in messages[0]
    assert "dtype bf16, expected the target's fp32" in messages[1]
    assert "1 of 5 rows hold NaN or Inf" in messages[2] and "batch positions [1]" in messages[2]
    assert "batch positions [0]" in messages[3]
    assert [r.request_id for r in out[4].results] == ["c", "d"]
    assert all(r.tree.tokens[0] == 9 for r in out[4].results)
    print(f"\ndraft: 4 refused batches + 1 served in {elapsed * 1000:.0f} ms")
    runtime = stack.draft.runtime  # the ended stream's "c" and "d" are freed with it
    assert wait_until(lambda: not runtime.live and not runtime.drafter.cache.requests)


def test_good_request_is_served_exactly_after_the_refusals(stack) -> None:
    prompt = [5, 6, 7, 8]
    ids = collect(stack.client.generate(prompt_token_ids=prompt, sampling=greedy(12)))[0]
    assert ids == stack.expected(prompt, 12)
    text_ids = collect(stack.client.generate(prompt="def f(x):", sampling=greedy(6)))[0]
    assert len(text_ids) == 6


def test_stop_strings_at_the_limits_still_work(stack) -> None:
    """32 stop strings of 256 characters each are accepted and only end the request if met."""
    stop = [chr(0x4E00 + i) * 256 for i in range(32)]  # never produced by the tiny tokenizer
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=tuple(stop))
    ids, _, last = collect(stack.client.generate(prompt_token_ids=[5, 6], sampling=params))
    assert ids == stack.expected([5, 6], 8) and last.finish_reason == "length"


def test_huge_verify_tree_is_refused_before_any_mask(stack) -> None:
    """A 40 000-node tree (160 KB on the wire) would have cost an n x n mask of 1.6 GB: the
    size is checked before anything is built, for that request alone, and the stream serves on."""
    from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc

    prefill = target_pb2.PrefillRequest(request_id="t", input_ids=[5, 6, 7])
    prefill.sampling.max_new_tokens = 4
    n = 40_000
    tree = common_pb2.DraftTree(tokens=[5] * n, parents=[-1, *range(n - 1)])
    verify = target_pb2.VerifyBatch(requests=[target_pb2.VerifyRequest(request_id="t", tree=tree)])
    batches = [
        target_pb2.TargetStepRequest(
            batch_id=1, prefill=target_pb2.PrefillBatch(requests=[prefill])
        ),
        target_pb2.TargetStepRequest(batch_id=2, verify=verify),
        target_pb2.TargetStepRequest(
            batch_id=3, prefill=target_pb2.PrefillBatch(requests=[prefill])
        ),
    ]
    before = rss_mb()
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.host.port}") as channel:
        started = time.monotonic()
        out = list(target_pb2_grpc.TargetStub(channel).Step(iter(batches), timeout=30))
        elapsed = time.monotonic() - started
    print(f"40k-node tree refused in {elapsed * 1000:.0f} ms, RSS {rss_mb() - before:+.0f} MB")
    result = out[1].results[0]
    assert result.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "40000 nodes exceeds 64" in result.status.message
    assert out[2].results[0].token_ids  # the failed request was dropped: its id is free again
    assert elapsed < 5.0 and rss_mb() - before < 200
