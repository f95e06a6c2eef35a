"""Prometheus series of online learning, read at scrape time from the draft's learner (none
while the service loads, or without ``--online-learning``). Every series carries
``service="draft"``; the weight version is the one the draft serves now."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.draft_service.online.learner import LearnerStats

COUNTERS = (
    ("updates", "num_updates", "Online learning updates the guard kept"),
    ("rollbacks", "num_rollbacks", "Online learning updates the guard rolled back"),
    ("resets", "num_resets", "Rollbacks that brought the shipped weights back"),
    ("tokens_observed", "tokens_observed", "Rows (feature, token) kept for online learning"),
    ("train_seconds", "train_seconds", "Seconds the trainer thread spent in updates"),
    ("swap_seconds", "swap_seconds", "Seconds draft steps spent copying a new version in"),
)
GAUGES = (
    ("weight_version", "version", "Version of the head the draft serves (0 = as loaded)"),
    ("loss", "last_loss", "Mean training loss of the last update"),
    ("train_tokens", "train_tokens", "Rows buffered to train on"),
    ("heldout_tokens", "heldout_tokens", "Held-out rows buffered for the guard"),
)
ACCEPT = (("before", "heldout_before"), ("after", "heldout_after"), ("shipped", "heldout_shipped"))


class OnlineCollector:
    """Register on a draft servicer's registry: ``registry.register(OnlineCollector(s))``."""

    def __init__(self, servicer, service: str = "draft") -> None:
        self.servicer, self.service = servicer, service

    def collect(self) -> list:
        learner = getattr(self.servicer.runtime, "learner", None)
        return [] if learner is None else families(learner.stats(), self.service)


def families(stats: LearnerStats, service: str) -> list:
    out = []
    for name, field, doc in COUNTERS:
        family = CounterMetricFamily(f"specmesh_online_{name}", doc, labels=["service"])
        family.add_metric([service], getattr(stats, field))
        out.append(family)
    for name, field, doc in GAUGES:
        family = GaugeMetricFamily(f"specmesh_online_{name}", doc, labels=["service"])
        family.add_metric([service], getattr(stats, field))
        out.append(family)
    accept = GaugeMetricFamily(
        "specmesh_online_heldout_accept_length",
        "Simulated accept length on held-out traffic at the last update: the served weights "
        "(before), the candidate (after), the shipped weights",
        labels=["service", "weights"],
    )
    for label, field in ACCEPT:
        accept.add_metric([service, label], getattr(stats, field))
    return [*out, accept]
