"""The benchmark plan (which configurations run, in which order), the side-by-side comparisons
and the issue's goals.

Order: the configurations a comparison divides are run back to back (per batch size), so a
ratio compares runs taken under the same machine load; ``repeats`` runs the whole plan again
and keeps each configuration's fastest run (the one least disturbed by other work).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from specmesh.bench.runners import RunSpec
from specmesh.defaults import ModelChoice
from specmesh.draft_service.drafter import SpecParams

SWEEP = (
    SpecParams(3, 1, 4),
    SpecParams(5, 1, 6),
    SpecParams(5, 4, 8),
    SpecParams(3, 4, 8),
    SpecParams(5, 8, 16),
)
ACCEPT_GOAL_SPEC, ACCEPT_GOAL = SpecParams(5, 4, 8), 3.0
ENGINE_BASELINE = "torch"  # the engine variant the others are divided by


@dataclass(frozen=True)
class Comparison:
    """ratio = tokens/s of ``numerator`` / tokens/s of ``denominator`` at the same batch size,
    code workload, greedy. A side is (backend, speculative?)."""

    name: str
    numerator: tuple[str, bool]
    denominator: tuple[str, bool]
    goals: dict[int, float] = field(default_factory=dict)  # batch size -> minimum ratio


COMPARISONS = (
    Comparison("speculative_vs_plain", ("inprocess", True), ("inprocess", False), {1: 1.5}),
    Comparison("grpc_cluster_vs_inprocess", ("cluster", True), ("inprocess", True), {1: 0.9, 8: 1.0}),
    Comparison("grpc_router_vs_inprocess", ("grpc", True), ("inprocess", True)),
    Comparison("plain_vs_transformers", ("inprocess", False), ("transformers", False), {1: 1.0, 8: 1.0}),
)  # fmt: skip


@dataclass(frozen=True)
class BenchSettings:
    models: ModelChoice
    spec: SpecParams  # speculation of the main grid and of the comparisons
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    compare_batch_sizes: tuple[int, ...] = (1, 8)
    workloads: tuple[str, ...] = ("code", "text")
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_new_tokens: int = 96
    prompt_len: int = 96
    min_requests: int = 8  # a configuration runs max(batch_size, min_requests) requests
    repeats: int = 1
    grpc: bool = True
    transformers: bool = True
    sweep: tuple[SpecParams, ...] = SWEEP
    runtime: dict[str, Any] = field(default_factory=dict)  # attention_backend, dtype, device
    service_args: tuple[str, ...] = ()
    # In-process engine variants ("torch", "triton", "triton+graphs", ...; see engine_variants),
    # each run plain and speculative, code, greedy, at engine_batch_sizes.
    engines: tuple[str, ...] = ()
    engine_batch_sizes: tuple[int, ...] = (1, 16)

    def validate(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.max_new_tokens < 1 or self.repeats < 1 or self.min_requests < 1:
            raise ValueError("--max-new-tokens, --repeats and --min-requests must be >= 1")
        for spec in (self.spec, *self.sweep):
            spec.validate()
        if self.engines and self.engines[0] != ENGINE_BASELINE:
            raise ValueError(f"engine variants must start with {ENGINE_BASELINE!r}: {self.engines}")


def engine_variants(attention_backends: tuple[str, ...], device: str) -> tuple[str, ...]:
    """Every backend run eagerly, plus ``<backend>+graphs`` where CUDA graphs run (a CUDA device
    and a backend with graph hooks); the torch backend first, as the baseline."""
    from specmesh.runtime.graph_runner import graphs_enabled

    out = [ENGINE_BASELINE]
    for b in attention_backends:
        out += [b] if b != ENGINE_BASELINE else []
        out += [f"{b}+graphs"] if graphs_enabled(True, device, b) else []
    return tuple(out)


def plan(s: BenchSettings) -> list[RunSpec]:
    runs: dict[str, RunSpec] = {}

    def add(backend: str, workload: str, b: int, temp: float, spec: SpecParams | None) -> None:
        n = max(b, s.min_requests)
        run = RunSpec(backend, workload, b, temp, spec, s.max_new_tokens, n)
        runs.setdefault(run.name, run)

    for c, b in comparisons(s):
        for backend, speculative in (c.numerator, c.denominator):
            if _enabled(s, backend):
                add(backend, "code", b, 0.0, s.spec if speculative else None)
    for spec in s.sweep:
        add("inprocess", "code", 1, 0.0, spec)
    for workload in s.workloads:
        for temp in s.temperatures:
            for b in s.batch_sizes:
                add("inprocess", workload, b, temp, s.spec)
    for b in s.batch_sizes:
        add("inprocess", "code", b, 0.0, None)
        if s.transformers:
            add("transformers", "code", b, 0.0, None)
        if s.grpc:
            add("grpc", "code", b, 0.0, s.spec)
    return list(runs.values())


def comparisons(s: BenchSettings) -> list[tuple[Comparison, int]]:
    """Every side-by-side comparison with its batch size, engine variants grouped by variant."""
    out = [(c, b) for b in s.compare_batch_sizes for c in COMPARISONS]
    for v in s.engines[1:]:
        for speculative in (False, True):
            mode = "speculative" if speculative else "plain"
            sides = (f"engine:{v}", speculative), (f"engine:{ENGINE_BASELINE}", speculative)
            c = Comparison(f"{v}_vs_{ENGINE_BASELINE}_{mode}", *sides)
            out += [(c, b) for b in s.engine_batch_sizes]
    return out


def _enabled(s: BenchSettings, backend: str) -> bool:
    return {"grpc": s.grpc, "cluster": s.grpc, "transformers": s.transformers}.get(backend, True)


def compare(s: BenchSettings, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key = {
        (c["backend"], c["speculative"], c["batch_size"]): c
        for c in configs
        if c["workload"] == "code" and c["temperature"] == 0.0 and _is_main(s, c)
    }
    out = []
    for c, b in comparisons(s):
        num, den = by_key.get((*c.numerator, b)), by_key.get((*c.denominator, b))
        if num is None or den is None:
            continue
        ratio = _ratio(num["tokens_per_s"], den["tokens_per_s"])
        goal = c.goals.get(b)
        out.append({
            "name": c.name, "batch_size": b, "metric": "tokens_per_s",
            "numerator": num["name"], "denominator": den["name"],
            "numerator_value": num["tokens_per_s"], "denominator_value": den["tokens_per_s"],
            "ratio": ratio, "goal": goal, "met": None if goal is None else ratio >= goal,
        })  # fmt: skip
    return out


def _is_main(s: BenchSettings, config: dict[str, Any]) -> bool:
    """Plain configurations, or speculative ones with the main (not a sweep) spec."""
    if not config["speculative"]:
        return True
    spec = (config["num_steps"], config["topk"], config["num_draft_tokens"])
    return spec == (s.spec.num_steps, s.spec.topk, s.spec.num_draft_tokens)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def goals(comparisons: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [
        _goal(f"{c['name']}@b{c['batch_size']}", "ratio", c["ratio"], c["goal"])
        for c in comparisons
        if c["goal"] is not None
    ]
    g = ACCEPT_GOAL_SPEC
    with contextlib.suppress(StopIteration):
        c = next(
            c
            for c in configs
            if c["backend"] == "inprocess" and c["workload"] == "code" and c["batch_size"] == 1
            and c["temperature"] == 0.0
            and (c["num_steps"], c["topk"], c["num_draft_tokens"]) == (g.num_steps, g.topk, g.num_draft_tokens)
        )  # fmt: skip
        name = f"mean_accept_len_code_{g.num_steps}_{g.topk}_{g.num_draft_tokens}"
        out.append(_goal(name, "mean_accept_len", c["mean_accept_len"], ACCEPT_GOAL))
    return out


def _goal(name: str, metric: str, value: float, target: float) -> dict[str, Any]:
    return {
        "name": name,
        "metric": metric,
        "value": value,
        "target": target,
        "met": value >= target,
    }
