"""Prometheus metrics of a model service (target or draft): `ServiceMetrics`, one registry per
servicer (several services in one test process never collide), served at ``/metrics`` on
``--metrics-port`` (0 = off; `add_metrics_port_arg`).

Recorded per Step batch on the worker thread (`ServiceMetrics.timed` wraps the servicer's
answer): the runtime's latency and the batch's size, by work kind (prefill, decode, verify,
extend, propose, release, open). Read at scrape time from what the service already reports in
`GetInfo` (`ModelServicer.info(...).occupancy`, one owner for each number): KV slots used /
free, requests held, open Step streams, prefix-cache and run-ahead counters. Every series
carries ``service="target"|"draft"``. No histogram exports ``_created`` samples
(`disable_created_metrics`, as the router's registry: vLLM exports none either).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from specmesh.rpc.service_common import ModelServicer

log = logging.getLogger(__name__)
disable_created_metrics()  # for every registry of the process

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)


def add_metrics_port_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (--host's address; 0 = off)",
    )


class ServiceMetrics:
    def __init__(self, servicer: ModelServicer) -> None:
        self.registry = CollectorRegistry()
        self.service = servicer.host.service_name.rsplit(".", 1)[-1].lower()  # target / draft
        labels = ("service", "kind")
        self.step_latency = Histogram(
            "specmesh_step_latency_seconds", "Runtime time of one Step batch, by work kind",
            labels, buckets=STEP_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_size = Histogram(
            "specmesh_step_batch_size", "Requests in one Step batch, by work kind",
            labels, buckets=BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_Occupancy(servicer, self.service))
        self.server = None

    def timed(self, answer: Callable[..., list]) -> Callable[..., list]:
        """``answer(runtime, stream, chunks)`` observed by the kind of the batch's work."""

        def run(runtime, stream, chunks: list) -> list:
            started = time.perf_counter()
            try:
                return answer(runtime, stream, chunks)
            finally:
                self.observe(chunks[0], time.perf_counter() - started)

        return run

    def observe(self, head, seconds: float) -> None:
        kind = head.WhichOneof("work")
        if kind is None:
            return
        work = getattr(head, kind)
        self.step_latency.labels(self.service, kind).observe(seconds)
        if kind == "release":
            self.batch_size.labels(self.service, kind).observe(len(work.request_ids))
        elif hasattr(work, "requests"):
            self.batch_size.labels(self.service, kind).observe(len(work.requests))

    def serve(self, port: int | None, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (None = off, 0 = any free
        port); returns the bound port (0 when off)."""
        if port is None:
            return 0
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self.server.server_port
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, bound)
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _Occupancy:
    """What the service holds, asked of the servicer at scrape time (nothing while loading)."""

    def __init__(self, servicer: ModelServicer, service: str) -> None:
        self.servicer, self.service = servicer, service

    def collect(self):
        runtime = self.servicer.runtime
        if runtime is None:
            return []
        occ = self.servicer.info(runtime).occupancy
        total = occ.kv_slots_used + occ.kv_slots_free
        values = [
            ("kv_cache_used_slots", "KV cache token slots in use", occ.kv_slots_used),
            ("kv_cache_free_slots", "KV cache token slots free", occ.kv_slots_free),
            ("kv_cache_usage_perc", "KV cache slots in use, 0 to 1",
             occ.kv_slots_used / total if total else 0.0),
            ("num_requests_held", "Requests whose state the service holds", occ.num_requests),
            ("num_open_streams", "Open Step streams (router connections)", occ.num_streams),
        ]  # fmt: skip
        families = []
        for name, doc, value in values:
            family = GaugeMetricFamily(f"specmesh_{name}", doc, labels=["service"])
            family.add_metric([self.service], value)
            families.append(family)
        return families + self._prefix_cache(runtime) + self._run_ahead(runtime)

    def _run_ahead(self, runtime) -> list:
        """Plain steps a target decided ahead, and how many answered a verify
        (`target_service.run_ahead`)."""
        ahead = getattr(runtime, "ahead", None)
        if ahead is None:
            return []
        return self._counters([
            ("run_ahead_steps", "Plain decode steps decided ahead of the router's verify", ahead.num_runs),
            ("run_ahead_hits", "Steps decided ahead that answered the router's verify", ahead.num_hits),
        ])  # fmt: skip

    def _counters(self, series: list[tuple[str, str, float]]) -> list:
        """One counter family per (name, doc, value), labelled with this service."""
        families = []
        for name, doc, value in series:
            family = CounterMetricFamily(f"specmesh_{name}", doc, labels=["service"])
            family.add_metric([self.service], value)
            families.append(family)
        return families

    def _prefix_cache(self, runtime) -> list:
        """vLLM's prefix-cache counters, in prompt tokens (a target with its cache on)."""
        blocks = getattr(getattr(runtime, "prefixes", None), "blocks", None)
        if blocks is None:
            return []
        families = self._counters([
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", blocks.num_queried),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", blocks.num_hit),
        ])  # fmt: skip
        gauge = GaugeMetricFamily("specmesh_prefix_cache_tokens", "Tokens the prefix cache holds",
                                  labels=["service"])  # fmt: skip
        gauge.add_metric([self.service], blocks.num_tokens)
        return [*families, gauge]
