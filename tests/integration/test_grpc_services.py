"""The three gRPC services in one process: real `grpc.aio` servers on loopback, run by a
background event loop; the tests talk to them through `GenerationClient` and raw stubs.

Greedy output through the router equals transformers' (EAGLE-3, the sibling-last oracle draft
that makes verify accept several tokens out of tree order, and without speculation); 32 concurrent streams; a cancelled
stream frees its KV in both services; every bad input gets its precise status while the
services keep serving; a restarted draft is used again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import assert_accepted
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    count_batches,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from oracle_draft import mean_accept, oracle_draft_runtime
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.rpc.health import check_health
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90]]
CODE = grpc.StatusCode


# -- correctness -------------------------------------------------------------------------------
@pytest.mark.parametrize("speculate", [True, False], ids=["eagle3", "disable_speculation"])
def test_greedy_through_router_matches_transformers(copy_stack, speculate: bool) -> None:
    """The EAGLE-3 draft predicts its target (`copy_stack`): speculative rounds accept tokens."""
    stack = copy_stack
    drafted, hits = count_batches(stack.draft), stack.target.runtime.ahead.num_hits
    stats = []
    for prompt, n in zip(PROMPTS, [14, 9, 11, 20], strict=True):
        call = stack.client.generate(
            prompt_token_ids=prompt, sampling=greedy(n), disable_speculation=not speculate
        )
        ids, _, last = collect(call)
        assert ids == stack.expected(prompt, n)
        assert last.finish_reason == "length" and last.stats.completion_tokens == n
        accept_lens = list(last.stats.accept_lens)
        assert last.stats.num_rounds == len(accept_lens) and sum(accept_lens) >= n - 1
        if not speculate:
            assert accept_lens == [1] * (n - 1)  # one token per round after the prefill's
        stats.append(last.stats)
    assert (drafted["batches"] > 0) == speculate
    if speculate:
        assert_accepted(stats, min_tokens=len(PROMPTS))
    if not speculate:  # the target ran every decode step ahead but the first (`run_ahead`)
        assert stack.target.runtime.ahead.num_hits - hits == sum(n - 2 for n in [14, 9, 11, 20])


def test_text_prompt_is_tokenized_and_detokenized(stack) -> None:
    from specmesh.router.tokenizer import load_tokenizer

    tok = load_tokenizer(stack.dirs.target)
    prompt = "def add(a, b):"
    ids, text, last = collect(stack.client.generate(prompt, sampling=greedy(12)))
    prompt_ids = tok.encode(prompt, add_special_tokens=True)
    assert ids == stack.expected(prompt_ids, 12)
    assert last.stats.prompt_tokens == len(prompt_ids)
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_oracle_draft_accepts_several_tokens_per_round(stack) -> None:
    """The sibling-last oracle (`oracle_draft`) as the draft service: several feature rows per
    request cross both hops each round, and the target keeps the KV of a path that is never a
    prefix of tree order."""
    runtime = oracle_draft_runtime(stack.dirs.target)
    draft = stack.loop.run(serve_draft(runtime))
    router = stack.loop.run(serve_router(stack.target, draft))
    n = 20
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            calls = [client.generate(prompt_token_ids=p, sampling=greedy(n)) for p in PROMPTS]
            stats = []
            for prompt, call in zip(PROMPTS, calls, strict=True):
                ids, _, last = collect(call)
                assert ids == stack.expected(prompt, n)
                stats.append(last.stats)
        assert max(a for s in stats for a in s.accept_lens) == 4
        assert mean_accept(stats) >= 2.2, [list(s.accept_lens) for s in stats]
    finally:
        stack.loop.run(router.stop(0.5))
        stack.loop.run(draft.host.shutdown(0.5))


def test_32_concurrent_streams_are_all_correct(copy_stack) -> None:
    """With a draft that predicts its target (`copy_stack`): rounds accept draft tokens."""
    stack = copy_stack
    prompts = [[(7 * i + j) % 300 + 3 for j in range(2 + i % 7)] for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    results: list = [None] * 32
    stats: list = [None] * 32

    def run(i: int) -> None:
        call = stack.client.generate(prompt_token_ids=prompts[i], sampling=greedy(lengths[i]))
        results[i], _, last = collect(call)
        stats[i] = last.stats

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt, n, ids in zip(prompts, lengths, results, strict=True):
        assert ids == stack.expected(prompt, n)
    assert_accepted(stats, min_tokens=32)


def test_two_routers_sharing_services_take_the_same_client_ids(stack) -> None:
    """A rolling update: two routers on one target and one draft, each streaming requests with
    the same client ids at once. Service-side ids carry a per-router prefix, so nothing collides
    (issue 33 #8: ALREADY_EXISTS), every output is exact and both services hold nothing after."""
    other = stack.loop.run(serve_router(stack.target, stack.draft))
    n, results = 12, {}

    def run(port: int, i: int) -> None:
        with GenerationClient(f"127.0.0.1:{port}") as client:
            call = client.generate(
                prompt_token_ids=PROMPTS[i], sampling=greedy(n), request_id=f"req-{i}"
            )
            results[port, i] = collect(call)[0]

    try:
        ports = (stack.router.port, other.port)
        threads = [threading.Thread(target=run, args=(p, i)) for p in ports for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for port in ports:
            for i, prompt in enumerate(PROMPTS):
                assert results.get((port, i)) == stack.expected(prompt, n), (port, i)
    finally:
        stack.loop.run(other.stop(0.5))
    services = {"target": stack.target.host.port, "draft": stack.draft.host.port}
    held = lambda: {k: occupancy(f"127.0.0.1:{p}", k) for k, p in services.items()}
    assert wait_until(lambda: all(is_empty(o) for o in held().values())), held()
    assert not stack.target.runtime.requests and not stack.draft.runtime.live


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_ended_stream_frees_kv_in_both_services(stack, how: str) -> None:
    call = stack.client.generate(
        prompt_token_ids=[5, 6, 7],
        sampling=greedy(900),
        timeout=0.5 if how == "deadline" else None,
    )
    stream = iter(call)
    next(stream), next(stream)
    assert stack.target.runtime.cache.requests  # held while streaming
    if how == "cancel":
        call.cancel()
    else:
        with pytest.raises(grpc.RpcError) as e:
            collect(stream)
        assert e.value.code() == CODE.DEADLINE_EXCEEDED
    target_cache, draft_cache = stack.target.runtime.cache, stack.draft.runtime.drafter.cache
    assert wait_until(lambda: not target_cache.requests and not draft_cache.requests)
    assert not stack.target.runtime.requests and not stack.draft.runtime.live
    assert not stack.router.core.requests


def test_losing_the_only_target_is_unavailable_after_the_streamed_tokens(stack) -> None:
    target = stack.loop.run(serve_target(TargetRuntime(TargetConfig(stack.dirs.target))))
    router = stack.loop.run(serve_router(target))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            stream = iter(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(900)))
            got = [*next(stream).token_ids, *next(stream).token_ids]
            stack.loop.run(target.host.shutdown(0.0))
            with pytest.raises(grpc.RpcError) as e:
                for response in stream:
                    got += response.token_ids
            assert e.value.code() == CODE.UNAVAILABLE, e.value.details()
            assert got == stack.expected([5, 6, 7], len(got))  # streamed tokens stay valid
            assert client.info().num_target_replicas == 0
    finally:
        stack.loop.run(router.stop(0.5))


# -- health, reflection, restarts ----------------------------------------------------------------
def test_health_reflection_and_info(stack) -> None:
    services = {
        stack.target.host.port: "specmesh.v1.Target",
        stack.draft.host.port: "specmesh.v1.Draft",
        stack.router.port: "specmesh.v1.Generation",
    }
    for port, name in services.items():
        assert check_health(f"127.0.0.1:{port}", "") and check_health(f"127.0.0.1:{port}", name)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            reply = next(
                stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            )
            listed = {s.name for s in reply.list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= listed
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name)
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    info = stack.client.info()
    assert (info.vocab_size, info.draft_kind, info.num_draft_tokens) == (320, "eagle3", 6)
    assert info.num_target_replicas == 1 and info.num_draft_replicas == 1


def test_health_cli_prints_the_real_status(stack, capsys: pytest.CaptureFixture) -> None:
    """``specmesh health``: SERVING exits 0; a service the server does not know (NOT_FOUND) is
    SERVICE_UNKNOWN with exit 3, not NOT SERVING (issue 33 #16); nobody listening exits 1."""
    from specmesh.cli.main import main

    address = f"127.0.0.1:{stack.target.host.port}"
    assert main(["health", address, "--service", "specmesh.v1.Target"]) == 0
    assert capsys.readouterr().err.strip() == f"{address} specmesh.v1.Target: SERVING"
    assert main(["health", address, "--service", "nope"]) == 3
    assert capsys.readouterr().err.strip() == f"{address} nope: SERVICE_UNKNOWN"
    assert main(["health", "127.0.0.1:1", "--timeout", "1"]) == 1
    assert capsys.readouterr().err.strip() == "127.0.0.1:1 (server): UNAVAILABLE"


def test_restarted_draft_is_used_again(stack) -> None:
    eagle3 = load_draft(DraftConfig("eagle3", stack.dirs.draft, stack.dirs.target, SPEC))
    draft = stack.loop.run(serve_draft(eagle3))
    port = draft.host.port
    router = stack.loop.run(serve_router(stack.target, draft))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            run = lambda: collect(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(8)))[
                0
            ]
            stack.loop.run(draft.host.shutdown(0.2))  # SIGTERM path: NOT_SERVING, drain, stop
            assert not check_health(f"127.0.0.1:{port}", "specmesh.v1.Draft", timeout_s=1.0)
            assert run() == stack.expected([5, 6, 7], 8)  # the draft is down: no speculation
            again = stack.loop.run(serve_draft(eagle3, port))
            drafted = count_batches(again)
            time.sleep(0.3)  # the circuit breaker's cooldown
            assert run() == stack.expected([5, 6, 7], 8)
            assert drafted["batches"] > 0  # a new request speculates with the new draft
            stack.loop.run(again.host.shutdown(0.2))
    finally:
        stack.loop.run(router.stop(0.5))


def test_image_request_speculates_over_grpc(tmp_path: Path) -> None:
    """LLaVA target + EAGLE-3 draft as services: placeholders expand on the target, the draft
    gets mm_input_embeds and the expanded ids, the output equals transformers'."""
    from specmesh.runtime.tiny_llava import make_tiny_llava, make_tiny_llava_eagle3, tiny_image

    make_tiny_llava(tmp_path / "target")
    make_tiny_llava_eagle3(tmp_path / "draft", tmp_path / "target", seed=1)
    target_dir, draft_dir = str(tmp_path / "target"), str(tmp_path / "draft")
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir))))
    spec = SpecParams(3, 2, 5)
    draft = loop.run(serve_draft(load_draft(DraftConfig("eagle3", draft_dir, target_dir, spec))))
    drafted = count_batches(draft)
    router = loop.run(serve_router(target, draft))
    prompt, image = "def <image> add(a, b):", tiny_image(0)
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            assert client.info().supports_images
            ids = collect(client.generate(prompt, sampling=greedy(10), images=[image]))[0]
    finally:
        loop.run(router.stop(0.5))
        for servicer in (target, draft):
            loop.run(servicer.host.shutdown(0.5))
        loop.close()
    assert ids == llava_greedy(target_dir, prompt, image, 10)
    assert drafted["batches"] > 0 and not any(drafted["codes"])  # every request speculated


def llava_greedy(model_dir: str, prompt: str, image: bytes, n: int) -> list[int]:
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    pil = [Image.open(io.BytesIO(image)).convert("RGB")]
    inputs = AutoProcessor.from_pretrained(model_dir)(text=prompt, images=pil, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_a_seed_fixes_the_output_through_the_cluster(stack) -> None:
    """Four identical sampled requests with a seed give one output, the same as with
    speculation off (the sampling contract: keyed draws, `test_seeded_sampling`); so does issue
    54's shape, a 450-token prompt at temperature 0.9 with seed 708."""
    from specmesh.protocol.sampling import SamplingParams

    long = [(37 * i + 11) % 300 + 4 for i in range(450)]
    for prompt, temperature, seed in [(PROMPTS[0], 0.8, 42), (long, 0.9, 708)]:
        params = SamplingParams(
            max_new_tokens=16, temperature=temperature, seed=seed, ignore_eos=True
        )
        run = lambda p=prompt, s=params, **kw: tuple(
            collect(stack.client.generate(prompt_token_ids=p, sampling=s, **kw))[0]
        )
        outputs = {run() for _ in range(4)}
        assert outputs == {run(disable_speculation=True)}, prompt[:8]


def test_a_shared_prefix_comes_from_the_prefix_cache(stack) -> None:
    """The second of two prompts sharing 40 tokens reuses the first's two full 16-token blocks
    (KV and the draft's feature rows): stats say so, the output is exact, GetInfo counts the
    cached tokens and nothing stays held."""
    shared = [(7 * i + 3) % 200 + 4 for i in range(40)]
    cached = []
    for tail in ([5, 6, 7], [9, 8]):
        prompt = shared + tail
        ids, _, last = collect(stack.client.generate(prompt_token_ids=prompt, sampling=greedy(8)))
        assert ids == stack.expected(prompt, 8)
        cached.append(last.stats.cached_tokens)
    assert cached[0] == 0 and cached[1] == 32
    target = f"127.0.0.1:{stack.target.host.port}"
    assert wait_until(lambda: is_empty(occupancy(target, "target")))
    assert occupancy(target, "target").prefix_cached_tokens >= 32
