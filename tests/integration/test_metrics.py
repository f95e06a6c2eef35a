"""Prometheus metrics through real gRPC services in process.

The router's speculative counters agree exactly with the requests' own `RequestStats` (two
routers in one process, one drafting with the random EAGLE-3 head and one with the target
itself so that every draft token is accepted: one registry, no double registration, deltas add
up), and so do its request histograms (one observation per request, phases that add up to TTFT
and e2e); every series carries the served model's name; the Grafana dashboard asks only for
series that exist. What Prometheus scrapes over HTTP, KV usage and preemptions:
`test_metrics_scrape`.
"""

from __future__ import annotations

import json
import re
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
MODEL = "target"  # the tiny checkpoint's folder: what /v1/models and every series name
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "time_per_output_token_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens",
)
NAME = re.compile(r"^specmesh_[a-z0-9_]+$")


def _value(name: str, **labels: str) -> float:
    """A router sample of the stack's model (0 when it has none yet)."""
    return REGISTRY.get_sample_value(f"specmesh_{name}", {"model_name": MODEL, **labels}) or 0.0


def _router_snapshot() -> dict[str, float]:
    snap = {name: _value(f"{name}_total") for name in COUNTERS}
    for pos in range(MAX_POSITIONS):
        snap[f"pos{pos}"] = _value(
            "spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)
        )
    for name in HISTOGRAMS:
        snap[f"{name}_count"] = _value(f"{name}_count")
        snap[f"{name}_sum"] = _value(f"{name}_sum")
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
    # Drafts: at most one per round, at least one per round that accepted a draft token; every
    # tree has the draft's size (root excluded); what is accepted was drafted.
    rounds = sum(s.num_rounds for s in stats)
    assert sum(a > 1 for a in accept_lens) <= delta["spec_decode_num_drafts"] <= rounds
    self_rounds = sum(s.num_rounds for s in stats[len(PROMPTS) :])
    assert delta["spec_decode_num_drafts"] >= self_rounds  # the self-draft never fails
    assert delta["spec_decode_num_accepted_tokens"] <= delta["spec_decode_num_draft_tokens"]
    assert max(accept_lens) == SELF_SPEC.num_steps + 1  # the self-draft is accepted in full
    _check_request_histograms(delta, stats)


def _check_request_histograms(delta: dict[str, float], stats: list) -> None:
    """One observation per request in each request histogram, token sums equal to the
    requests' own counts, and phases that add up: queue + prefill = TTFT (which equals the
    clients' own), prefill + decode = inference, queue + inference = e2e."""
    for name in HISTOGRAMS[:-1]:
        assert delta[f"{name}_count"] == len(stats), name
    total = lambda name: delta[f"{name}_sum"]
    assert total("request_prompt_tokens") == sum(s.prompt_tokens for s in stats)
    assert total("request_generation_tokens") == sum(s.completion_tokens for s in stats)
    # Each verify step observes the tokens it produced: every round's accept length, once.
    assert total("iteration_tokens") == sum(a for s in stats for a in s.accept_lens)
    assert 1 <= delta["iteration_tokens_count"] <= sum(s.num_rounds for s in stats)
    approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-9)
    queue, prefill = total("request_queue_time_seconds"), total("request_prefill_time_seconds")
    decode, inference = (
        total("request_decode_time_seconds"),
        total("request_inference_time_seconds"),
    )
    ttft, e2e = total("time_to_first_token_seconds"), total("e2e_request_latency_seconds")
    assert ttft == approx(sum(s.time_to_first_token_s for s in stats))
    assert queue + prefill == approx(ttft) and prefill + decode == approx(inference)
    assert queue + inference == approx(e2e) and e2e <= sum(s.total_time_s for s in stats)
    assert min(queue, prefill) >= 0 and decode > 0
    # Every request generated 20 tokens: its time per output token is decode / 19.
    assert total("time_per_output_token_seconds") == approx(decode / 19)


def test_router_gauges_and_per_replica_series(stack) -> None:
    collect(stack.client.generate(prompt_token_ids=PROMPTS[0], sampling=greedy(8)))
    target, draft = stack.router.core.targets[0].name, stack.router.core.drafts[0].name
    sample = lambda name, **labels: REGISTRY.get_sample_value(
        f"specmesh_{name}", {"model_name": MODEL, **labels}
    )  # fmt: skip
    assert stack.router.core.metrics.model == MODEL
    assert sample("circuit_breaker_open", replica=target) == 0.0
    assert sample("circuit_breaker_open", replica=draft) == 0.0
    assert sample("target_step_latency_seconds_count", replica=target) > 0
    assert sample("draft_step_latency_seconds_count", replica=draft) > 0
    assert sample("num_requests_running") == sample("num_requests_waiting") == 0.0
    # KV usage as each service reported it at connect (or since), and the target's cache config.
    for replica in (target, draft):
        assert 0.0 <= sample("kv_cache_usage_perc", replica=replica) <= 1.0
    num_kv_slots = str(stack.target.runtime.cfg.num_kv_slots)
    (config,) = [
        s
        for f in REGISTRY.collect()
        if f.name == "specmesh_cache_config_info"
        for s in f.samples
        if s.labels["replica"] == target
    ]
    assert config.value == 1 and config.labels["num_kv_slots"] == num_kv_slots
    assert config.labels["model_name"] == MODEL and config.labels["dtype"]


def test_step_bytes_and_prefill_latency_per_replica(stack) -> None:
    """Each request adds Step bytes both ways on the target and the draft it ran on, and one
    prefill step (requests sent one at a time, so none share a prefill batch) to the target's
    prefill histogram; the verify histogram keeps counting verify steps only."""
    target, draft = stack.router.core.targets[0].name, stack.router.core.drafts[0].name
    # The byte counters carry no model name (a client counts before it knows the model).
    value = lambda name, replica: REGISTRY.get_sample_value(name, {"replica": replica}) or 0.0
    series = {
        "target_sent": ("specmesh_step_bytes_sent_total", target),
        "target_received": ("specmesh_step_bytes_received_total", target),
        "draft_sent": ("specmesh_step_bytes_sent_total", draft),
        "draft_received": ("specmesh_step_bytes_received_total", draft),
    }
    snapshot = lambda: {
        **{k: value(*v) for k, v in series.items()},
        "prefills": _value("target_prefill_latency_seconds_count", replica=target),
        "verifies": _value("target_step_latency_seconds_count", replica=target),
    }
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


def test_draft_metrics_registry_is_its_own(stack) -> None:
    """Each servicer registers on a registry of its own: target and draft in one process do
    not collide, and the draft's series say so."""
    assert stack.draft.metrics.registry is not stack.target.metrics.registry
    text = generate_latest(stack.draft.metrics.registry).decode()
    assert 'specmesh_kv_cache_used_slots{service="draft"}' in text
    assert 'specmesh_step_latency_seconds_count{kind="extend",service="draft"}' in text


def test_grafana_dashboard_asks_for_existing_series(stack) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "specmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    asked = {m for e in exprs for m in re.findall(r"specmesh_\w+", e)}
    registries = (REGISTRY, stack.target.metrics.registry, stack.draft.metrics.registry)
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    exposed = {f.name + s for r in registries for f in r.collect() for s in suffixes}
    missing = sorted(asked - exposed)
    assert asked and not missing, missing
