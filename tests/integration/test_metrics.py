"""Prometheus metrics through real gRPC services in process.

The router's speculative counters agree exactly with the requests' own `RequestStats` (two
routers in one process, one drafting with the random EAGLE-3 head and one with the target
itself so that every draft token is accepted: one registry, no double registration, deltas add
up); a target's ``/metrics`` endpoint, scraped over HTTP, shows KV slots held while a request
streams and none after; the Grafana dashboard asks only for series that exist.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpc_harness import collect, greedy, serve_draft, serve_router, wait_until
from prometheus_client import generate_latest

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.router.metrics import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
SELF_SPEC = SpecParams(3, 1, 4)  # the target drafting for itself: a chain, every token accepted
COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "prompt_tokens",
    "generation_tokens",
)
MAX_POSITIONS = 8


def _router_snapshot() -> dict[str, float]:
    value = lambda name, labels=None: REGISTRY.get_sample_value(name, labels or {}) or 0.0
    snap = {name: value(f"specmesh:{name}_total") for name in COUNTERS}
    for pos in range(MAX_POSITIONS):
        snap[f"pos{pos}"] = value(
            "specmesh:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(pos)}
        )
    snap["ttft_count"] = value("specmesh:time_to_first_token_seconds_count")
    snap["e2e_count"] = value("specmesh:e2e_request_latency_seconds_count")
    return snap


@pytest.fixture(scope="module")
def self_drafting(stack):
    """A second router on the stack's target, drafting with the target's own weights."""
    runtime = load_draft(DraftConfig("standalone", stack.dirs.target, stack.dirs.target, SELF_SPEC))
    draft = stack.loop.run(serve_draft(runtime))
    router = stack.loop.run(serve_router(stack.target, draft))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield SimpleNamespace(client=client, router=router)
    client.close()
    stack.loop.run(router.stop(0.5))
    stack.loop.run(draft.host.shutdown(0.5))


def test_spec_decode_counters_equal_the_requests_stats(stack, self_drafting) -> None:
    before = _router_snapshot()
    stats = []
    for client in (stack.client, self_drafting.client):
        for prompt in PROMPTS:
            ids, _, last = collect(client.generate(prompt_token_ids=prompt, sampling=greedy(20)))
            assert ids == stack.expected(prompt, 20)
            stats.append(last.stats)
    for router in (stack.router, self_drafting.router):
        assert wait_until(lambda r=router: not r.core.requests)  # every request has ended there
    delta = {k: v - before[k] for k, v in _router_snapshot().items()}

    accept_lens = [a for s in stats for a in s.accept_lens]
    assert delta["spec_decode_num_accepted_tokens"] == sum(a - 1 for a in accept_lens)
    for pos in range(MAX_POSITIONS):
        assert delta[f"pos{pos}"] == sum(a - 1 > pos for a in accept_lens), pos
    assert delta["prompt_tokens"] == sum(s.prompt_tokens for s in stats)
    assert delta["generation_tokens"] == sum(s.completion_tokens for s in stats) == 6 * 20
    assert delta["ttft_count"] == delta["e2e_count"] == len(stats)
    # Drafts: at most one per round, at least one per round that accepted a draft token; every
    # tree has the draft's size (root excluded); what is accepted was drafted.
    rounds = sum(s.num_rounds for s in stats)
    assert sum(a > 1 for a in accept_lens) <= delta["spec_decode_num_drafts"] <= rounds
    self_rounds = sum(s.num_rounds for s in stats[len(PROMPTS) :])
    assert delta["spec_decode_num_drafts"] >= self_rounds  # the self-draft never fails
    assert delta["spec_decode_num_accepted_tokens"] <= delta["spec_decode_num_draft_tokens"]
    assert max(accept_lens) == SELF_SPEC.num_steps + 1  # the self-draft is accepted in full


def test_router_gauges_and_per_replica_series(stack) -> None:
    collect(stack.client.generate(prompt_token_ids=PROMPTS[0], sampling=greedy(8)))
    text = generate_latest(REGISTRY).decode()
    target, draft = stack.router.core.targets[0].name, stack.router.core.drafts[0].name
    assert f'specmesh:circuit_breaker_open{{replica="{target}"}} 0.0' in text
    assert f'specmesh:circuit_breaker_open{{replica="{draft}"}} 0.0' in text
    assert f'specmesh:target_step_latency_seconds_count{{replica="{target}"}}' in text
    assert f'specmesh:draft_step_latency_seconds_count{{replica="{draft}"}}' in text
    assert "specmesh:num_requests_running " in text and "specmesh:num_requests_waiting " in text


def test_step_bytes_and_prefill_latency_per_replica(stack) -> None:
    """Each request adds Step bytes both ways on the target and the draft it ran on, and one
    prefill step (requests sent one at a time, so none share a prefill batch) to the target's
    prefill histogram; the verify histogram keeps counting verify steps only."""
    target, draft = stack.router.core.targets[0].name, stack.router.core.drafts[0].name
    value = lambda name, replica: REGISTRY.get_sample_value(name, {"replica": replica}) or 0.0
    series = {
        "target_sent": ("specmesh:step_bytes_sent_total", target),
        "target_received": ("specmesh:step_bytes_received_total", target),
        "draft_sent": ("specmesh:step_bytes_sent_total", draft),
        "draft_received": ("specmesh:step_bytes_received_total", draft),
        "prefills": ("specmesh:target_prefill_latency_seconds_count", target),
        "verifies": ("specmesh:target_step_latency_seconds_count", target),
    }
    snapshot = lambda: {k: value(*v) for k, v in series.items()}
    before = snapshot()
    rounds = 0
    for prompt in PROMPTS:
        *_, last = collect(stack.client.generate(prompt_token_ids=prompt, sampling=greedy(8)))
        rounds += last.stats.num_rounds
    assert wait_until(lambda: not stack.router.core.requests)
    delta = {k: v - before[k] for k, v in snapshot().items()}
    # A prompt token alone is at least a byte each way; the answers carry tokens (and the
    # draft's rows carry hidden states), so every direction grows by more than the prompts.
    num_prompt_tokens = sum(len(p) for p in PROMPTS)
    for key in ("target_sent", "target_received", "draft_sent", "draft_received"):
        assert delta[key] > num_prompt_tokens, (key, delta)
    assert delta["prefills"] == len(PROMPTS)
    assert delta["verifies"] == rounds, (rounds, delta)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_target_metrics_endpoint_shows_kv_held_while_streaming(stack) -> None:
    metrics = stack.target.metrics
    port = metrics.serve(0, "127.0.0.1")  # what `specmesh target --metrics-port` starts
    used = 'specmesh:kv_cache_used_slots{service="target"}'
    held = 'specmesh:num_requests_held{service="target"}'
    try:
        assert wait_until(lambda: _scrape(port)[used] == 0)
        responses = stack.client.generate(prompt_token_ids=PROMPTS[2], sampling=greedy(30))
        next(responses)  # prefilled: the target holds the request's KV
        gate = threading.Event()
        stack.target.worker.submit(gate.wait)  # hold the target's worker: the request waits
        try:
            during = _scrape(port)
        finally:
            gate.set()
        ids = [*next(responses).token_ids]
        collect(responses)
        assert during[used] >= len(PROMPTS[2]) and during[held] == 1
        assert during['specmesh:num_open_streams{service="target"}'] >= 1
        assert 0 < during['specmesh:kv_cache_usage_perc{service="target"}'] < 1
        assert ids
        assert wait_until(lambda: _scrape(port)[used] == 0 and _scrape(port)[held] == 0)
        after = _scrape(port)
        assert after['specmesh:step_latency_seconds_count{kind="verify",service="target"}'] > 0
        assert after['specmesh:step_batch_size_count{kind="prefill",service="target"}'] > 0
    finally:
        metrics.close()


def test_draft_metrics_registry_is_its_own(stack) -> None:
    """Each servicer registers on a registry of its own: target and draft in one process do
    not collide, and the draft's series say so."""
    assert stack.draft.metrics.registry is not stack.target.metrics.registry
    text = generate_latest(stack.draft.metrics.registry).decode()
    assert 'specmesh:kv_cache_used_slots{service="draft"}' in text
    assert 'specmesh:step_latency_seconds_count{kind="extend",service="draft"}' in text


def test_grafana_dashboard_asks_for_existing_series(stack) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "specmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    asked = {m for e in exprs for m in re.findall(r"specmesh:\w+", e)}
    registries = (REGISTRY, stack.target.metrics.registry, stack.draft.metrics.registry)
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    exposed = {f.name + s for r in registries for f in r.collect() for s in suffixes}
    missing = sorted(asked - exposed)
    assert asked and not missing, missing
