"""The router's gauges, read at scrape time from every live core (`LiveCores`), and the model
services' KV occupancy as the router last saw it (`KvOccupancy`).

Nothing here is kept twice: requests running / waiting, breaker states and the policy's tree
sizes are the cores' own state, read when ``/metrics`` is scraped. A waiting request waits for
``capacity`` (its first admission: no replica has room, or its micro-batch worker is busy) or
to be replayed (``replay``: a worker admitted it before and it left its replicas: preempted or
refused for KV space, its target failed, or a draft is back for it); the reasons add up to
``num_requests_waiting``. Scrapes may run on another thread than the cores': each core's dicts
are copied with one C-level call before they are read.

KV occupancy lives in the services; the router sees it through GetInfo (``occupancy``): once at
connect (`KvOccupancy.seed`), then every `KV_POLL_S` (`KvOccupancy.poll`, started with the core).
A service that does not answer keeps the value the router last saw. Replicas without GetInfo
(the in-process clients of an `Engine`) report none.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore
    from specmesh.router.replica import Replica

KV_POLL_S = 5.0  # seconds between two GetInfo asks for a replica's KV occupancy
# What `cache_config_info` reads off a target's connect-time GetInfo (`TargetInfo`); the page
# size is not reported there, so it is not a label.
CACHE_CONFIG = ("max_context_len", "max_batch_size", "max_tokens_per_batch", "dtype",
                "attention_backend", "tensor_parallel_size")  # fmt: skip


class KvOccupancy:
    """KV token slots (used, free) per replica name, as its service last reported them."""

    def __init__(self) -> None:
        self.slots: dict[str, tuple[int, int]] = {}

    def seed(self, replicas: Iterable[Replica]) -> None:
        """What each service answered at connect."""
        for r in replicas:
            info = getattr(r.client, "info_pb", None)
            if info is not None:
                self._record(r.name, info.occupancy)

    async def refresh(self, replicas: Iterable[Replica]) -> None:
        """Ask every gRPC replica now, concurrently; one that fails keeps its last value."""
        asked = [r for r in replicas if hasattr(r.client, "get_info")]
        answers = await asyncio.gather(
            *(r.client.get_info(0.0) for r in asked), return_exceptions=True
        )
        for r, info in zip(asked, answers, strict=True):
            if not isinstance(info, BaseException):
                self._record(r.name, info.occupancy)

    async def poll(self, replicas: list[Replica], interval_s: float = KV_POLL_S) -> None:
        """`refresh` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh(replicas)

    def usage(self) -> dict[str, float]:
        """Used / (used + free) per replica, 0 to 1."""
        return {name: used / (used + free) if used + free else 0.0
                for name, (used, free) in dict(self.slots).items()}  # fmt: skip

    def _record(self, name: str, occupancy) -> None:
        self.slots[name] = (occupancy.kv_slots_used, occupancy.kv_slots_free)


_MODEL, _REPLICA = ("model_name",), ("model_name", "replica")
WAITING_REASONS = ("capacity", "replay")
# name -> (help, label names); values of one replica seen by several cores: the largest.
GAUGES = {
    "num_requests_running": ("Requests in a micro-batch", _MODEL),
    "num_requests_waiting": ("Requests waiting for admission (new or to replay)", _MODEL),
    "num_requests_waiting_by_reason": (
        "Requests waiting for admission, by reason: capacity (never admitted yet), replay "
        "(admitted before, to be rebuilt elsewhere or again); they add up to num_requests_waiting",
        (*_MODEL, "reason"),
    ),
    "circuit_breaker_open": ("Replica breaker: 0 closed, 1 open", _REPLICA),
    "spec_decode_tree_size": (
        "Tree size (nodes incl. the root) the speculation policy chose last for this target "
        "replica's micro-batches; 1 = not speculating",
        _REPLICA,
    ),
    "kv_cache_usage_perc": (
        "KV cache slots in use at this replica, 0 to 1, as its service last reported them",
        _REPLICA,
    ),
    "cache_config_info": (
        "A target replica's cache config, as its GetInfo reported it at connect (labels); 1",
        (*_REPLICA, "num_kv_slots", *CACHE_CONFIG),
    ),
}
Samples = dict[str, dict[tuple[str, ...], float]]  # gauge name -> label values -> value


class LiveCores:
    """The scrape-time collector over every live core (weakly held: a stopped `Engine` core
    disappears with it). Series carry the core's model name: cores of one model add up their
    requests, and a replica shows the largest value any of them sees."""

    def __init__(self) -> None:
        self.cores: weakref.WeakSet[RouterCore] = weakref.WeakSet()

    def collect(self) -> list[GaugeMetricFamily]:
        samples: Samples = {name: {} for name in GAUGES}
        for core in list(self.cores):
            _read(core, samples)
        families = []
        for name, (doc, labels) in GAUGES.items():
            family = GaugeMetricFamily(f"specmesh_{name}", doc, labels=labels)
            for values, value in sorted(samples[name].items()):
                family.add_metric(values, value)
            families.append(family)
        return families


def _read(core: RouterCore, samples: Samples) -> None:
    _requests(core, samples)
    model = core.metrics.model

    def put(name: str, labels: tuple[str, ...], value: float) -> None:
        key = (model, *labels)
        samples[name][key] = max(samples[name].get(key, value), value)

    for r in core.replicas.all:
        put("circuit_breaker_open", (r.name,), int(not r.live))
    for name, size in dict(core.metrics.tree_sizes).items():
        put("spec_decode_tree_size", (name,), size)
    for name, usage in core.metrics.kv.usage().items():
        put("kv_cache_usage_perc", (name,), usage)
    for r in core.replicas.targets:
        info, slots = getattr(r.client, "info_pb", None), core.metrics.kv.slots.get(r.name)
        if info is not None and slots is not None:
            config = (str(sum(slots)), *(str(getattr(info, f)) for f in CACHE_CONFIG))
            put("cache_config_info", (r.name, *config), 1)


def _requests(core: RouterCore, samples: Samples) -> None:
    """Requests running and waiting (by reason), added to those of the model's other cores."""
    model = core.metrics.model
    counts = {("num_requests_running", model): 0, ("num_requests_waiting", model): 0}
    counts |= {("num_requests_waiting_by_reason", model, r): 0 for r in WAITING_REASONS}
    for slot in list(core.slots.values()):
        if slot.request.finished:
            continue
        if slot.worker is not None:  # admitted to a worker
            counts[("num_requests_running", model)] += 1
            continue
        counts[("num_requests_waiting", model)] += 1
        reason = "replay" if core.metrics.scheduled(slot.rid) else "capacity"
        counts[("num_requests_waiting_by_reason", model, reason)] += 1
    for (name, *labels), count in counts.items():
        key = tuple(labels)
        samples[name][key] = samples[name].get(key, 0) + count
