"""The keys of the results document (``results.json``); `check` reports what is missing."""

from __future__ import annotations

from typing import Any

TOP_LEVEL = ("meta", "configs", "comparisons", "goals")
META = (
    "cpu_model", "num_cpus", "threads", "gpu", "torch", "transformers", "started_at", "models",
    "skipped", "settings",
)  # fmt: skip
CONFIG = (
    # what ran
    "name", "backend", "dtype", "workload", "batch_size", "temperature", "speculative",
    "draft_kind", "num_steps", "topk", "num_draft_tokens", "max_new_tokens", "num_requests",
    # where it ran: one process per repeat (pids in repeat order), its thread count
    "repeats", "pids", "threads",
    # throughput (median over the repeats, spread, each repeat's value) and latency (median run)
    "generated_tokens", "wall_s", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
    "tokens_per_s_runs", "ttft_s_mean",
    "ttft_s_p50", "itl_s_p50", "itl_s_p99", "tpot_s_mean",
    # speculation
    "num_rounds", "mean_accept_len", "accept_per_position",
    # where the time and the bytes go
    "time_split", "wire_bytes", "bytes_per_token", "bytes_scope",
)  # fmt: skip
TIME_SPLIT = ("wall_s", "target_s", "draft_s", "router_s", "network_s", "note")
# ratio: of the medians; ratio_min / ratio_max / ratio_runs: per repeat, repeat i over repeat i
COMPARISON = (
    "name", "dtype", "batch_size", "metric", "numerator", "denominator", "numerator_value",
    "denominator_value", "ratio", "ratio_min", "ratio_max", "ratio_runs", "goal", "met",
)  # fmt: skip
GOAL = ("name", "metric", "value", "target", "met")


def check(results: dict[str, Any]) -> list[str]:
    """Every missing key, as ``where: key``; empty when the document is complete."""
    missing = [f"results: {k}" for k in TOP_LEVEL if k not in results]
    missing += [f"meta: {k}" for k in META if k not in results.get("meta", {})]
    for c in results.get("configs", []):
        missing += [f"{c.get('name')}: {k}" for k in CONFIG if k not in c]
        missing += [
            f"{c.get('name')}.time_split: {k}"
            for k in TIME_SPLIT
            if k not in c.get("time_split", {})
        ]
    for c in results.get("comparisons", []):
        missing += [f"comparison {c.get('name')}: {k}" for k in COMPARISON if k not in c]
    for g in results.get("goals", []):
        missing += [f"goal {g.get('name')}: {k}" for k in GOAL if k not in g]
    return missing
