"""The benchmark plan (which configurations run, in which order), the side-by-side comparisons
and the goals.

Every configuration runs in a fresh process per repeat (`bench.session`), and the repeats are
interleaved: the whole plan once, then again (A1 B1 C1 A2 B2 C2 ...), so slow drift of the
machine's load touches every side alike. Within one pass the two sides of a comparison run back
to back; a ratio divides the medians and also reports the min / max of the per-repeat ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specmesh.bench.hf import DRAFT_KINDS as TRANSFORMERS_DRAFTING
from specmesh.bench.metrics import ratio_spread
from specmesh.bench.runners import RunSpec
from specmesh.defaults import ModelChoice
from specmesh.protocol.config import SpecParams

SWEEP = (
    SpecParams(3, 1, 4),
    SpecParams(5, 1, 6),
    SpecParams(5, 4, 8),
    SpecParams(3, 4, 8),
    SpecParams(5, 8, 16),
)
ACCEPT_GOAL_SPEC, ACCEPT_GOAL = SpecParams(5, 4, 8), 3.0
ENGINE_BASELINE = "torch"  # the engine variant the others are divided by
DTYPES = ("fp32", "bf16")
TRANSFORMERS_LABEL = {"ngram": "transformers_lookup", "standalone": "transformers_assisted"}


@dataclass(frozen=True)
class Side:
    backend: str  # inprocess, engine:<variant>, cluster, transformers, llamacpp
    draft_kind: str | None = None  # None = plain decoding
    speculation: str = "always"  # the router's policy when drafting (`RunSpec.speculation`)


@dataclass(frozen=True)
class Comparison:
    """ratio = tokens/s of ``numerator`` / tokens/s of ``denominator``: same batch size, dtype
    and prompts (code workload, greedy)."""

    name: str
    numerator: Side
    denominator: Side
    batch_sizes: tuple[int, ...]
    goals: dict[int, float] = field(default_factory=dict)  # batch size -> minimum ratio


@dataclass(frozen=True)
class BenchSettings:
    models: ModelChoice  # the target and the main draft
    spec: SpecParams  # speculation of every drafting side and of the grid
    dtypes: tuple[str, ...] = DTYPES
    draft_kinds: tuple[str, ...] = ("eagle3", "ngram", "standalone")  # the main kind first
    draft_dirs: dict[str, str | None] = field(default_factory=dict)  # kind -> checkpoint
    compare_batch_sizes: tuple[int, ...] = (1, 8, 32)  # specmesh plain vs transformers
    cluster_batch_sizes: tuple[int, ...] = (1, 8)  # gRPC cluster vs in process
    batch_sizes: tuple[int, ...] = (1, 8)  # the grid (first dtype, main draft)
    workloads: tuple[str, ...] = ("code", "text")
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_new_tokens: int = 96
    prompt_len: int = 96
    min_requests: int = 8  # a configuration runs max(batch_size, min_requests) requests
    repeats: int = 3
    cluster: bool = True
    transformers: bool = True
    llamacpp: bool = True
    llamacpp_python: str = "python3"  # an interpreter that can import llama_cpp
    gguf_dir: str = ""  # target-f32.gguf / target-bf16.gguf (bench.llamacpp)
    sweep: tuple[SpecParams, ...] = SWEEP
    runtime: dict[str, Any] = field(default_factory=dict)  # attention_backend, device
    threads: int = 1  # torch threads of every measured process (the cluster splits them)
    # One core per device (`bench.worker.ONE_DEVICE` / `TWO_DEVICES`, one thread each): the
    # split measured as on two devices, the in-process sides on one.
    pin: bool = False
    cluster_draft_args: tuple[str, ...] = ()  # flags the cluster's draft gets (--predraft N)
    # In-process engine variants ("torch", "triton", "triton+graphs", ...; see engine_variants),
    # each run plain and with the main draft, code, greedy, at engine_batch_sizes.
    engines: tuple[str, ...] = ()
    engine_batch_sizes: tuple[int, ...] = (1, 16)

    def validate(self) -> None:
        sizes = (*self.batch_sizes, *self.compare_batch_sizes, *self.cluster_batch_sizes)
        if not self.batch_sizes or min(sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {sizes}")
        if min(self.max_new_tokens, self.repeats, self.min_requests, self.threads) < 1:
            raise ValueError("--max-new-tokens, --repeats, --min-requests, --threads must be >= 1")
        for spec in (self.spec, *self.sweep):
            spec.validate()
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if not self.dtypes or unknown:
            raise ValueError(f"--dtypes takes {', '.join(DTYPES)}; got {self.dtypes}")
        if not self.draft_kinds or self.draft_kinds[0] != self.models.draft_kind:
            raise ValueError(f"the draft kinds must start with {self.models.draft_kind!r}")
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


def comparisons(s: BenchSettings) -> list[Comparison]:
    """The table of the README, in the order the plan runs them."""
    main = s.models.draft_kind
    plain, hf_plain = Side("inprocess"), Side("transformers")
    out = [Comparison("plain_vs_transformers", plain, hf_plain, s.compare_batch_sizes, {1: 1.0, 8: 1.0})]  # fmt: skip
    for kind in s.draft_kinds:
        drafting = Side("inprocess", kind)
        if kind in TRANSFORMERS_DRAFTING:
            out.append(Comparison(f"{kind}_vs_{TRANSFORMERS_LABEL[kind]}", drafting, Side("transformers", kind), (1,)))  # fmt: skip
        else:
            out.append(Comparison(f"{kind}_vs_transformers", drafting, hf_plain, (1,)))
        out.append(Comparison(f"{kind}_vs_plain", drafting, plain, (1,), {1: 1.5} if kind == main else {}))  # fmt: skip
    # Speculation that never loses: the adaptive policy against plain at every batch size.
    adaptive = Side("inprocess", main, "adaptive")
    out.append(Comparison(f"{main}_adaptive_vs_transformers", adaptive, hf_plain, (1,), {1: 1.5}))  # fmt: skip
    out.append(Comparison(f"{main}_adaptive_vs_plain", adaptive, plain, s.compare_batch_sizes,
                          dict.fromkeys(s.compare_batch_sizes, 1.0)))  # fmt: skip
    out.append(Comparison("llamacpp_vs_plain", Side("llamacpp"), plain, (1,)))
    cluster, local = Side("cluster", main), Side("inprocess", main)
    out.append(Comparison("cluster_vs_inprocess", cluster, local, s.cluster_batch_sizes, {1: 0.9, 8: 1.0}))  # fmt: skip
    for v in s.engines[1:]:
        for kind in (None, main):
            sides = Side(f"engine:{v}", kind), Side(f"engine:{ENGINE_BASELINE}", kind)
            c = Comparison(f"{v}_vs_{ENGINE_BASELINE}_{kind or 'plain'}", *sides, s.engine_batch_sizes)  # fmt: skip
            out.append(c)
    return [c for c in out if _enabled(s, c.numerator) and _enabled(s, c.denominator)]


def _enabled(s: BenchSettings, side: Side) -> bool:
    flags = {"cluster": s.cluster, "transformers": s.transformers, "llamacpp": s.llamacpp}
    return flags.get(side.backend, True)


def plan(s: BenchSettings) -> list[RunSpec]:
    """One pass: every comparison per dtype (its sides back to back), then, in the first dtype,
    the (steps, topk, draft tokens) sweep and the workload x temperature x batch grid."""
    runs: dict[str, RunSpec] = {}

    def add(side: Side, dtype: str, workload: str, b: int, temp: float, spec: SpecParams) -> None:
        drafting = spec if side.draft_kind else None
        n = max(b, s.min_requests)
        run = RunSpec(side.backend, workload, b, temp, drafting, s.max_new_tokens, n, dtype, side.draft_kind, side.speculation)  # fmt: skip
        runs.setdefault(run.name, run)

    for dtype in s.dtypes:
        for c in comparisons(s):
            for b in c.batch_sizes:
                for side in (c.numerator, c.denominator):
                    add(side, dtype, "code", b, 0.0, s.spec)
    main, dtype = Side("inprocess", s.models.draft_kind), s.dtypes[0]
    for spec in s.sweep:
        add(main, dtype, "code", 1, 0.0, spec)
    for workload in s.workloads:
        for temp in s.temperatures:
            for b in s.batch_sizes:
                add(main, dtype, workload, b, temp, s.spec)
    return list(runs.values())


def interleave(runs: list[RunSpec], repeats: int) -> list[tuple[int, RunSpec]]:
    """(repeat, run) in the order they execute: the whole plan, then the whole plan again."""
    return [(r, run) for r in range(repeats) for run in runs]


def compare(s: BenchSettings, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every comparison whose two sides ran, per dtype and batch size (code, greedy, main spec)."""
    by_key = {
        (
            c["backend"],
            c["draft_kind"],
            c.get("speculation", "always"),
            c["dtype"],
            c["batch_size"],
        ): c
        for c in configs
        if c["workload"] == "code" and c["temperature"] == 0.0 and _is_main(s, c)
    }
    out = []
    for dtype in s.dtypes:
        for c in comparisons(s):
            for b in c.batch_sizes:
                num = by_key.get((*_key(c.numerator), dtype, b))
                den = by_key.get((*_key(c.denominator), dtype, b))
                if num is not None and den is not None:
                    out.append(_comparison(c, dtype, b, num, den))
    return out


def _key(side: Side) -> tuple[str, str | None, str]:
    return side.backend, side.draft_kind, side.speculation if side.draft_kind else "never"


def _comparison(c: Comparison, dtype: str, b: int, num: dict, den: dict) -> dict[str, Any]:
    ratios = ratio_spread(num["tokens_per_s_runs"], den["tokens_per_s_runs"])
    goal = c.goals.get(b)
    return {
        "name": c.name, "dtype": dtype, "batch_size": b, "metric": "tokens_per_s",
        "numerator": num["name"], "denominator": den["name"],
        "numerator_value": num["tokens_per_s"], "denominator_value": den["tokens_per_s"],
        **ratios, "goal": goal, "met": None if goal is None else ratios["ratio"] >= goal,
    }  # fmt: skip


def _is_main(s: BenchSettings, config: dict[str, Any]) -> bool:
    """Plain configurations, or drafting ones with the main (not a sweep) spec."""
    if not config["speculative"]:
        return True
    spec = (config["num_steps"], config["topk"], config["num_draft_tokens"])
    return spec == (s.spec.num_steps, s.spec.topk, s.spec.num_draft_tokens)


def goals(comparisons: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [
        _goal(f"{c['name']}@{c['dtype']}/b{c['batch_size']}", "ratio", c["ratio"], c["goal"])
        for c in comparisons
        if c["goal"] is not None
    ]
    g = ACCEPT_GOAL_SPEC
    for c in configs:
        if (
            c["backend"] == "inprocess" and c["workload"] == "code" and c["batch_size"] == 1
            and c["temperature"] == 0.0 and c["draft_kind"] == "eagle3"
            and c.get("speculation", "always") == "always"
            and (c["num_steps"], c["topk"], c["num_draft_tokens"]) == (g.num_steps, g.topk, g.num_draft_tokens)
        ):  # fmt: skip
            name = f"mean_accept_len_code_{g.num_steps}_{g.topk}_{g.num_draft_tokens}@{c['dtype']}"
            out.append(_goal(name, "mean_accept_len", c["mean_accept_len"], ACCEPT_GOAL))
    return out


def _goal(name: str, metric: str, value: float, target: float) -> dict[str, Any]:
    return {"name": name, "metric": metric, "value": value, "target": target, "met": value >= target}  # fmt: skip
