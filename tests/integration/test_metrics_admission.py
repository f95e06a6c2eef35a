"""vLLM's admission, prefix-cache and request-parameter series on the router's ``/metrics``
(issue 51), scraped over HTTP after real requests through real gRPC services.

One router over the module's target and draft, with one micro-batch, room for two waiting
requests (``max_waiting=2``) and a tokenizer queue that holds none (``max_queued_prompts=0``):
a prefix hit counts its cached prompt tokens exactly as the target's own counters do; an
OpenAI request with ``n=2`` is one ``request_params_n`` observation of 2; each refusal is
counted by its reason; a request waits for capacity while the only worker's round is held at
the target, and a preempted one waits to be replayed; no series has a ``_created`` sample.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from grpc_harness import collect, greedy, held_worker, serve_router, serve_target, wait_until
from http_raw import request
from prometheus_client.parser import text_string_to_metric_families

from specmesh.client import GenerationClient
from specmesh.protocol.config import TargetConfig
from specmesh.router.limits import RouterLimits
from specmesh.router.metrics import REGISTRY
from specmesh.router.metrics_live import LiveCores
from specmesh.target_service.runtime import TargetRuntime

MODEL = "target"  # the tiny checkpoint's folder: the served model name every router series has
REASONS = ("invalid", "unsupported", "duplicate_id", "queue_full", "tokenizer_busy")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _scrape(port: int) -> Samples:
    """Every sample of the stack's model (and unlabelled ones) on the router's /metrics."""
    samples = {}
    for family in text_string_to_metric_families(_get(port)):
        for s in family.samples:
            if s.labels.get("model_name", MODEL) == MODEL:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _at(samples: Samples, name: str, **labels: str) -> float:
    key = (f"specmesh_{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples.get(key, 0.0)


def _delta(before: Samples, after: Samples):
    return lambda name, **labels: _at(after, name, **labels) - _at(before, name, **labels)


def _num_preemptions() -> float:
    return REGISTRY.get_sample_value("specmesh_num_preemptions_total", {"model_name": MODEL}) or 0


def _target_prefix(stack) -> tuple[float, float]:
    """The target's own prefix-cache counters (its ``--metrics-port`` registry)."""
    value = lambda n: stack.target.metrics.registry.get_sample_value(n, {"service": "target"})
    return value("specmesh_prefix_cache_queries_total"), value("specmesh_prefix_cache_hits_total")


@pytest.fixture(scope="module")
def front(stack):
    limits = RouterLimits(max_queued_prompts=0)
    router = stack.loop.run(
        serve_router(
            stack.target, stack.draft, http_port=0, settings={"limits": limits},
            num_micro_batches=1, max_waiting=2,
        )
    )  # fmt: skip
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield SimpleNamespace(router=router, client=client, port=router.http_port)
    client.close()
    stack.loop.run(router.stop(0.5))


def _idle(front) -> bool:
    return wait_until(lambda: not front.router.core.requests)


def test_a_prefix_hit_counts_its_cached_prompt_tokens_as_the_target_does(stack, front) -> None:
    """Two prompts sharing 40 tokens: the second finds two 16-token blocks. The router counts
    each request's prompt tokens and cached tokens once, as the target's own counters do, and
    observes the tokens its target computed and the max_tokens it ran with."""
    shared = [(13 * i + 7) % 200 + 4 for i in range(40)]
    prompts = [[*shared, 5, 6, 7], [*shared, 9, 8]]
    target_before, before = _target_prefix(stack), _scrape(front.port)
    cached = []
    for prompt in prompts:
        ids, _, last = collect(front.client.generate(prompt_token_ids=prompt, sampling=greedy(8)))
        assert ids == stack.expected(prompt, 8)
        cached.append(last.stats.cached_tokens)
    assert _idle(front)
    d, target_after = _delta(before, _scrape(front.port)), _target_prefix(stack)
    assert cached == [0, 32]
    num_prompt = sum(map(len, prompts))
    assert d("prefix_cache_queries_total") == num_prompt == target_after[0] - target_before[0]
    assert d("prefix_cache_hits_total") == 32 == target_after[1] - target_before[1]
    assert d("prompt_tokens_cached_total") == 32
    assert d("request_prefill_kv_computed_tokens_count") == 2
    assert d("request_prefill_kv_computed_tokens_sum") == num_prompt - 32  # 43 + 10
    assert d("request_prefill_kv_computed_tokens_bucket", le="10.0") == 1
    assert d("request_prefill_kv_computed_tokens_bucket", le="50.0") == 2
    assert d("request_params_max_tokens_count") == 2 and d("request_params_max_tokens_sum") == 16
    assert d("request_params_n_count") == d("request_params_n_sum") == 2  # gRPC: n = 1 each


def test_n_is_observed_once_per_prompt_and_max_tokens_once_per_choice(front) -> None:
    """An OpenAI completion with n=2: two requests, one `request_params_n` observation of 2,
    two of max_tokens."""
    before = _scrape(front.port)
    body = {"model": MODEL, "prompt": [21, 22, 23, 24], "n": 2, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = request(front.port, "POST", "/v1/completions", body)
    assert r.status == 200, r.body
    assert len(r.json()["choices"]) == 2
    assert _idle(front)
    d = _delta(before, _scrape(front.port))
    assert d("request_params_n_count") == 1 and d("request_params_n_sum") == 2
    assert d("request_params_n_bucket", le="1.0") == 0
    assert d("request_params_n_bucket", le="2.0") == 1
    assert d("request_params_max_tokens_count") == 2 and d("request_params_max_tokens_sum") == 10
    assert d("request_success_total", finished_reason="length") == 2
    assert d("prefix_cache_queries_total") == 8 and d("prefix_cache_hits_total") == 0


def _refused(call, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as e:
        collect(call)
    assert e.value.code() == code, e.value.details()


def test_refusals_are_counted_by_reason_and_waiting_requests_by_theirs(stack, front) -> None:
    """Refusals of every kind the router makes before a request runs, each counted once under
    its reason; while the only worker's round is held at the target, two arrivals wait for
    capacity, and a third is refused because the queue is full."""
    before = _scrape(front.port)
    exported = {dict(labels)["reason"] for (name, labels) in before
                if name == "specmesh_admission_rejections_total"}  # fmt: skip
    assert exported >= set(REASONS)
    client = front.client
    # invalid: the core's check (an id outside the vocabulary), the request checks (HTTP)
    _refused(client.generate(prompt_token_ids=[10**6], sampling=greedy(4)),
             grpc.StatusCode.INVALID_ARGUMENT)  # fmt: skip
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5000}
    assert request(front.port, "POST", "/v1/completions", body).status == 400
    # tokenizer_busy: the tokenizer queue holds no prompt on this router
    _refused(client.generate(prompt="def f(x):", sampling=greedy(4)),
             grpc.StatusCode.RESOURCE_EXHAUSTED)  # fmt: skip
    running = client.generate(prompt_token_ids=[30, 31, 32], sampling=greedy(40), request_id="a")
    first = next(running)
    with ThreadPoolExecutor(2) as pool:
        with held_worker(stack.target):  # the worker's next round waits at the target
            run = lambda p: collect(client.generate(prompt_token_ids=p, sampling=greedy(4)))[0]
            waiting = [pool.submit(run, p) for p in ([40, 41], [42, 43])]
            assert wait_until(lambda: len(front.router.core.waiting) == 2)
            _refused(client.generate(prompt_token_ids=[7, 8], sampling=greedy(4), request_id="a"),
                     grpc.StatusCode.ALREADY_EXISTS)  # fmt: skip
            _refused(client.generate(prompt_token_ids=[9, 8], sampling=greedy(4)),
                     grpc.StatusCode.RESOURCE_EXHAUSTED)  # fmt: skip
            during = _scrape(front.port)
        outputs = [f.result(60) for f in waiting]
    ids = [*first.token_ids, *collect(running)[0]]
    assert ids == stack.expected([30, 31, 32], 40)
    assert outputs == [stack.expected(p, 4) for p in ([40, 41], [42, 43])]
    d = _delta(before, during)
    counted = {r: d("admission_rejections_total", reason=r) for r in REASONS}
    want = {"invalid": 2, "unsupported": 0, "duplicate_id": 1, "queue_full": 1}
    assert counted == {**want, "tokenizer_busy": 1}
    assert _at(during, "num_requests_waiting") == 2
    assert _at(during, "num_requests_waiting_by_reason", reason="capacity") == 2
    assert _at(during, "num_requests_waiting_by_reason", reason="replay") == 0
    assert _idle(front)
    after = _scrape(front.port)
    assert _at(after, "num_requests_waiting_by_reason", reason="capacity") == 0
    # A refused request never ran: none of it is in the request series.
    assert _delta(before, after)("request_params_n_count") == 3


def test_preempted_requests_wait_to_be_replayed(stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target with 64 KV slots preempts some of 6 requests of 8 + 16 tokens; each time the
    worker looks for requests to admit, the waiting ones are split by reason (first admission
    or replay) and add up to the waiting gauge, and a preempted one waits as a replay."""
    small = stack.loop.run(
        serve_target(TargetRuntime(TargetConfig(stack.dirs.target, num_kv_slots=64)))
    )
    router = stack.loop.run(serve_router(small, max_batch_size=6, num_micro_batches=1))
    core, seen = router.core, []
    live = LiveCores()
    live.cores.add(core)
    admit = core._admit

    def sampled(*args):
        if core.waiting:
            seen.append(_waiting(live))
        return admit(*args)

    monkeypatch.setattr(core, "_admit", sampled)
    before = _num_preemptions()
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(6)]
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            run = lambda p: collect(
                client.generate(prompt_token_ids=p, sampling=greedy(16), timeout=60)
            )[0]
            with ThreadPoolExecutor(len(prompts)) as pool:
                outputs = list(pool.map(run, prompts))
        assert wait_until(lambda: not core.requests)
    finally:
        stack.loop.run(router.stop(0.5))
        stack.loop.run(small.host.shutdown(0.5))
    assert outputs == [stack.expected(p, 16) for p in prompts]
    assert _num_preemptions() > before
    assert seen and all(set(by_reason) == {"capacity", "replay"} for _, by_reason in seen), seen
    assert all(waiting == sum(by_reason.values()) for waiting, by_reason in seen)
    assert max(by_reason["replay"] for _, by_reason in seen) >= 1


def _waiting(live: LiveCores) -> tuple[float, dict[str, float]]:
    """The waiting gauge and its split by reason, as a scrape would read them now (on the
    core's own thread: between two of its steps)."""
    gauges = {f.name: f.samples for f in live.collect()}
    reasons = gauges.get("specmesh_num_requests_waiting_by_reason", [])
    (waiting,) = [s.value for s in gauges["specmesh_num_requests_waiting"]]
    return waiting, {s.labels["reason"]: s.value for s in reasons}


def test_no_series_exports_a_created_sample(stack, front) -> None:
    """Counters and histograms export no ``_created`` gauge (vLLM turns them off too): on the
    router's /metrics and on the target's and the draft's --metrics-port."""
    ports = {"target": stack.target.metrics.serve(0), "draft": stack.draft.metrics.serve(0)}
    try:
        texts = {name: _get(port) for name, port in {**ports, "router": front.port}.items()}
    finally:
        stack.target.metrics.close()
        stack.draft.metrics.close()
    for service, text in texts.items():
        created = [line for line in text.splitlines() if "_created" in line]
        assert "specmesh_" in text and not created, (service, created[:3])
