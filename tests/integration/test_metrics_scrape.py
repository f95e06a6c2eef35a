"""What Prometheus scrapes, through real gRPC services in process: every exposition (the
router's ``/metrics`` on its HTTP port, the target's and the draft's ``--metrics-port``) parses,
names only ``specmesh_[a-z0-9_]+`` and passes ``promtool check metrics`` where promtool is
installed; a target's endpoint shows KV slots held while a request streams and none after, and
the router's KV usage gauge follows it; a target with too few KV slots preempts running
requests, and the router counts exactly those preemptions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpc_harness import collect, greedy, held_worker, serve_router, serve_target, wait_until
from prometheus_client.parser import text_string_to_metric_families

from specmesh.client import GenerationClient
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.errors import KVCacheFullError
from specmesh.router.metrics import REGISTRY
from specmesh.target_service.runtime import TargetRuntime

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48]
MODEL = "target"  # the tiny checkpoint's folder: the served model name every router series has
NAME = re.compile(r"^specmesh_[a-z0-9_]+$")
# vLLM's series the router adds (issue 33 item 14), as exposed.
ROUTER_SERIES = (
    "kv_cache_usage_perc", "cache_config_info", "num_preemptions", "iteration_tokens",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "time_per_output_token_seconds", "request_prompt_tokens",
    "request_generation_tokens",
)  # fmt: skip


def _value(name: str, **labels: str) -> float:
    """A router sample of the stack's model (0 when it has none yet)."""
    return REGISTRY.get_sample_value(f"specmesh_{name}", {"model_name": MODEL, **labels}) or 0.0


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _scrape(port: int) -> dict[str, float]:
    samples = {}
    for line in _get(port).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_target_metrics_endpoint_shows_kv_held_while_streaming(stack) -> None:
    """The target's own gauges while a request holds KV there and after; the router's KV usage
    for that replica follows them once it asks GetInfo again (what its poll does)."""
    metrics = stack.target.metrics
    port = metrics.serve(0, "127.0.0.1")  # what `specmesh target --metrics-port` starts
    used = 'specmesh_kv_cache_used_slots{service="target"}'
    held = 'specmesh_num_requests_held{service="target"}'
    usage = 'specmesh_kv_cache_usage_perc{service="target"}'
    core = stack.router.core
    router_usage = lambda: _value("kv_cache_usage_perc", replica=core.targets[0].name)
    refresh = lambda: stack.loop.run(core.metrics.kv.refresh(core.replicas.all))
    try:
        assert wait_until(lambda: _scrape(port)[used] == 0)
        responses = stack.client.generate(prompt_token_ids=PROMPT, sampling=greedy(30))
        next(responses)  # prefilled: the target holds the request's KV
        with held_worker(stack.target):  # the request waits at the target
            during = _scrape(port)
            refresh()
            router_during = router_usage()
        ids = [*next(responses).token_ids]
        collect(responses)
        assert during[used] >= len(PROMPT) and during[held] == 1
        assert during['specmesh_num_open_streams{service="target"}'] >= 1
        assert 0 < during[usage] < 1 and 0 < router_during < 1
        assert ids
        assert wait_until(lambda: _scrape(port)[used] == 0 and _scrape(port)[held] == 0)
        after = _scrape(port)
        assert after['specmesh_step_latency_seconds_count{kind="verify",service="target"}'] > 0
        assert after['specmesh_step_batch_size_count{kind="prefill",service="target"}'] > 0
        hits = after['specmesh_run_ahead_hits_total{service="target"}']
        assert 0 <= hits <= after['specmesh_run_ahead_steps_total{service="target"}']
        refresh()
        assert router_usage() == after[usage] == 0.0
    finally:
        metrics.close()


@pytest.fixture(scope="module")
def expositions(stack) -> dict[str, str]:
    """What Prometheus would scrape, over HTTP, after a request: the router's ``/metrics`` on
    its HTTP port, the target's and the draft's ``--metrics-port``."""
    router = stack.loop.run(serve_router(stack.target, stack.draft, http_port=0))
    ports = {"target": stack.target.metrics.serve(0), "draft": stack.draft.metrics.serve(0)}
    ports["router"] = router.http_port
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            collect(client.generate(prompt_token_ids=PROMPT, sampling=greedy(8)))
        assert wait_until(lambda: not router.core.requests)
        return {name: _get(port) for name, port in ports.items()}
    finally:
        stack.target.metrics.close()
        stack.draft.metrics.close()
        stack.loop.run(router.stop(0.5))


def test_expositions_parse_with_underscore_names(expositions: dict[str, str]) -> None:
    """Every family and sample name is ``specmesh_[a-z0-9_]+`` (no colons: they are for
    recording rules), the text parses, and the router's carries vLLM's request series."""
    names = {}
    for service, text in expositions.items():
        families = list(text_string_to_metric_families(text))
        samples = [s.name for f in families for s in f.samples]
        bad = [n for n in [f.name for f in families] + samples if not NAME.match(n)]
        assert families and not bad, (service, bad)
        names[service] = {f.name for f in families}
    assert {f"specmesh_{n}" for n in ROUTER_SERIES} <= names["router"]
    # the registry is the process's: routers of earlier tests (other model names) are in it too
    counts = [s.labels for f in text_string_to_metric_families(expositions["router"])
              for s in f.samples if s.name == "specmesh_request_queue_time_seconds_count"]  # fmt: skip
    assert {"model_name": MODEL} in counts


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_every_exposition(expositions: dict[str, str]) -> None:
    for service, text in expositions.items():
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, (service, check.stdout, check.stderr)


def test_kv_pressure_preemptions_are_counted(stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """6 requests of 8 + 16 tokens want 144 KV slots at the end; a target with 64 preempts
    running requests (its verify refuses them for KV space others hold), and the router counts
    exactly those, while every output still equals transformers."""
    small = TargetRuntime(TargetConfig(stack.dirs.target, num_kv_slots=64))
    refused = {"verify": 0}
    verify = small.verify

    def counting(*args: object):
        out = verify(*args)
        refused["verify"] += sum(isinstance(e, KVCacheFullError) for e in out.errors.values())
        return out

    monkeypatch.setattr(small, "verify", counting)
    target = stack.loop.run(serve_target(small))
    router = stack.loop.run(serve_router(target, max_batch_size=6, num_micro_batches=1))
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(6)]
    before = _value("num_preemptions_total")
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            run = lambda p: collect(client.generate(prompt_token_ids=p, sampling=greedy(16)))[0]
            with ThreadPoolExecutor(len(prompts)) as pool:
                outputs = list(pool.map(run, prompts))
        assert wait_until(lambda: not router.core.requests)
        for prompt, ids in zip(prompts, outputs, strict=True):
            assert ids == stack.expected(prompt, 16)
        assert _value("num_preemptions_total") - before == refused["verify"] >= 1
        usage = _value("kv_cache_usage_perc", replica=router.core.targets[0].name)
        assert 0.0 <= usage <= 1.0
    finally:
        stack.loop.run(router.stop(0.5))
        stack.loop.run(target.host.shutdown(0.5))
