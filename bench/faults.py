"""The fault report: a local cluster through named fault scenarios, one table.

    python -m specmesh.bench.faults --out bench_results/faults      # or: specmesh bench --faults
    python -m specmesh.bench.faults --scenarios draft-kill,hostile-bodies

Each scenario (`specmesh.bench.fault_scenarios`) runs three phases of greedy gRPC streams
against a cluster of real processes (`specmesh.bench.fault_cluster`): *before* the fault,
*during* it (the fault lands once every request has its first tokens) and *after* it (once what
it killed is restarted and speculative requests reach every replica again, `wait_serving`).
Every request is checked against an in-process `Engine` decoding the same prompts plainly (no
draft, one process): a finished one must equal it, a cancelled one must be a prefix of it.
Afterwards every service must hold nothing: GetInfo occupancy of the targets and the draft, the
router's requests running / waiting. Consecutive scenarios on one cluster shape share a cluster.

Writes OUT/results.json and OUT/table.md; exits 1 if any output was wrong, any request failed,
the fault's own traffic got a wrong answer, or anything was held afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specmesh.bench.fault_cluster import (
    COUNTERS,
    DRAFT_SHAPE,
    ROUTER_FLAGS,
    Cluster,
    Load,
    Outcome,
    Req,
)
from specmesh.bench.fault_scenarios import (
    SCENARIOS,
    FaultContext,
    Scenario,
    standard,
)
from specmesh.defaults import ModelChoice, cache_dir
from specmesh.protocol.sampling import SamplingParams

PHASES = ("before", "during", "after")


class Oracle:
    """Greedy outputs of the in-process engine (target only, plain decoding), computed once per
    request, many in one batch."""

    def __init__(self, target: str) -> None:
        from specmesh.router.engine import Engine

        self.engine, self.known = Engine(target), {}

    def prepare(self, reqs: Sequence[Req]) -> None:
        todo = list({(r.prompt, r.max_new_tokens) for r in reqs} - self.known.keys())
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in todo]
        results = self.engine.generate([list(p) for p, _ in todo], params) if todo else []
        self.known.update({key: r.token_ids for key, r in zip(todo, results, strict=True)})

    def tokens(self, req: Req) -> list[int]:
        self.prepare([req])
        return self.known[(req.prompt, req.max_new_tokens)]

    def text(self, req: Req) -> str:
        return self.engine.tokenizer.decode(self.tokens(req), skip_special_tokens=True)


@dataclass
class PhaseSummary:
    num_requests: int
    failures: dict[str, int]  # gRPC status -> requests (the client's own cancels excluded)
    num_cancelled: int  # by the client, as the workload asked
    num_exact: int  # finished: equal to the oracle's; ended early: a prefix of it
    num_drafted: int  # requests the target verified draft tokens for
    p50_ms: float  # over the requests that finished
    p99_ms: float


@dataclass
class ScenarioResult:
    name: str
    note: str
    phases: dict[str, PhaseSummary]
    failures: dict[str, int]  # of the fault's own traffic (HTTP), beside the phases'
    held_after: dict[str, str]  # service -> what it still held; {} = nothing
    wall_s: float

    def problems(self) -> list[str]:
        """What went wrong: [] when every request was exact and nothing failed or was held."""
        wrong = [f"{n}: {p.num_requests - p.num_exact} not exact" for n, p in self.phases.items()
                 if p.num_exact < p.num_requests]  # fmt: skip
        wrong += [f"{n}: failed {p.failures}" for n, p in self.phases.items() if p.failures]
        wrong += [f"fault traffic: {self.failures}"] if self.failures else []
        return wrong + ([f"held after: {self.held_after}"] if self.held_after else [])


def summarize(reqs: Sequence[Req], outcomes: Sequence[Outcome], oracle: Oracle) -> PhaseSummary:
    def exact(req: Req, out: Outcome) -> bool:
        want = oracle.tokens(req)
        return out.tokens == (want if out.status == "OK" else want[: len(out.tokens)])

    own_cancel = lambda r, o: o.status == "CANCELLED" and r.cancel_after is not None
    failed = [
        o.status
        for r, o in zip(reqs, outcomes, strict=True)
        if o.status != "OK" and not own_cancel(r, o)
    ]
    done = sorted(o.latency_ms for o in outcomes if o.status == "OK")
    return PhaseSummary(
        num_requests=len(reqs),
        failures=dict(Counter(failed)),
        num_cancelled=sum(own_cancel(r, o) for r, o in zip(reqs, outcomes, strict=True)),
        num_exact=sum(exact(r, o) for r, o in zip(reqs, outcomes, strict=True)),
        num_drafted=sum(o.drafted for o in outcomes),
        p50_ms=percentile(done, 0.50),
        p99_ms=percentile(done, 0.99),
    )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest rank; 0 for no values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def run_scenario(s: Scenario, cluster: Cluster, oracle: Oracle) -> ScenarioResult:
    start = time.monotonic()
    workloads = {p: (s.during if p == "during" else standard) for p in PHASES}
    reqs = {p: workloads[p](random.Random(f"{s.name}/{p}")) for p in PHASES}
    oracle.prepare([r for rs in reqs.values() for r in rs])
    counters = cluster.metrics()
    outcomes = {"before": Load(cluster.router, reqs["before"]).join()}
    during = Load(cluster.router, reqs["during"])
    landed = during.wait_started()
    ctx = FaultContext(cluster, oracle.text, during.join)
    effect = s.fault(ctx)
    outcomes["during"] = during.join()
    mid = f" (at {landed:.0%} of the phase's tokens)" if s.during is standard else ""
    notes = [effect.note + mid]
    if s.recover is not None:
        notes.append(s.recover(ctx))
    back = cluster.wait_serving()
    notes.append(f"serving on every replica {back:.1f} s later" if back is not None else
                 "NOT serving on every replica after 60 s")  # fmt: skip
    outcomes["after"] = Load(cluster.router, reqs["after"]).join()
    held = cluster.wait_empty()
    grown = {k: v - counters.get(k, 0.0) for k, v in cluster.metrics().items() if k in COUNTERS}
    notes += [f"{COUNTERS[k]}: {v:.0f}" for k, v in sorted(grown.items()) if v]
    phases = {p: summarize(reqs[p], outcomes[p], oracle) for p in PHASES}
    return ScenarioResult(
        name=s.name,
        note="; ".join(notes),
        phases=phases,
        failures=dict(effect.failures),
        held_after=held,
        wall_s=time.monotonic() - start,
    )


def run_report(names: Sequence[str], models: ModelChoice, log_dir: Path) -> list[ScenarioResult]:
    """The scenarios ``names`` (keys of `SCENARIOS`) in order; each cluster's service logs in
    ``log_dir/<its first scenario>``."""
    start = time.monotonic()
    oracle, cluster, results = Oracle(models.target), None, []
    log(f"oracle engine loaded in {_since(start)}")
    try:
        for name in names:
            s = SCENARIOS[name]
            if cluster is not None and cluster.spec != s.cluster:
                cluster.stop()
                cluster = None
            if cluster is None:
                (log_dir / name).mkdir(parents=True, exist_ok=True)
                start = time.monotonic()
                cluster = Cluster(s.cluster, models, log_dir / name)
                log(f"cluster of {s.cluster.num_targets} target(s) ready in {_since(start)}")
            results.append(run_scenario(s, cluster, oracle))
            verdict = "; ".join(results[-1].problems()) or "ok"
            log(f"{name}: {verdict} ({results[-1].wall_s:.0f} s)")
    finally:
        if cluster is not None:
            cluster.stop()
    return results


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _since(start: float) -> str:
    return f"{time.monotonic() - start:.1f} s"


# -- the table -----------------------------------------------------------------------------------
COLUMNS = ("scenario", "fault, recovery, router counters", "requests b / d / a",
           "failures by status", "exact / checked", "drafted b / d / a", "p50 ms b / d / a",
           "p99 ms b / d / a", "held after")  # fmt: skip


def table_row(r: ScenarioResult) -> list[str]:
    ph = [r.phases[p] for p in PHASES]
    each = lambda f: " / ".join(f(p) for p in ph)
    counts = lambda p: (
        f"{p.num_requests}" + (f" ({p.num_cancelled} cancelled)" if p.num_cancelled else "")
    )
    failures = [
        f"{k}×{n} ({name})"
        for name, p in zip(PHASES, ph, strict=True)
        for k, n in p.failures.items()
    ]
    failures += [f"{k}×{n}" for k, n in r.failures.items()]
    held = "; ".join(f"{k}: {v}" for k, v in r.held_after.items()) or "nothing"
    return [
        r.name, r.note, each(counts), ", ".join(failures) or "none",
        f"{sum(p.num_exact for p in ph)} / {sum(p.num_requests for p in ph)}",
        each(lambda p: str(p.num_drafted)), each(lambda p: f"{p.p50_ms:.0f}"),
        each(lambda p: f"{p.p99_ms:.0f}"), held,
    ]  # fmt: skip


def markdown_table(results: Sequence[ScenarioResult]) -> str:
    rows = [COLUMNS, ["---"] * len(COLUMNS), *map(table_row, results)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def tiny_pair() -> ModelChoice:
    """A tiny random Llama and its EAGLE-3 draft, made once under $SPECMESH_CACHE/bench."""
    root = cache_dir() / "bench" / "faults-tiny"
    if not (root / "draft" / "config.json").is_file():
        from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

        make_tiny_target(root / "target")
        make_tiny_eagle3(root / "draft", root / "target", draft_vocab_size=200)
    return ModelChoice(str(root / "target"), str(root / "draft"), "eagle3")


def write_report(
    results: Sequence[ScenarioResult], out: Path, command: str, models: str, wall_s: float
) -> None:
    header = (
        f"# Fault report\n\n    {command}\n\n"
        f"{len(results)} scenarios in {wall_s:.0f} s on {os.cpu_count()} CPU cores "
        f"({time.strftime('%Y-%m-%d')}, {_revision()}), {models}: target(s), an EAGLE-3 draft "
        f"({' '.join(DRAFT_SHAPE)}) and a router ({' '.join(ROUTER_FLAGS)}, HTTP on), each "
        "`python -m specmesh <service>` with one torch thread. Phases b / d / a: before, "
        "during, after the fault; exact: a finished request equals the in-process engine's "
        "greedy output, a cancelled one is a prefix of it; drafted: requests the target "
        "verified draft tokens for; latency: whole request, finished ones; held after: GetInfo "
        "occupancy of every target and draft, the router's requests running and waiting.\n\n"
    )
    legend = "".join(f"- `{r.name}`: {SCENARIOS[r.name].what}\n" for r in results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(f"{header}{markdown_table(results)}\n\n{legend}")
    data = {"command": command, "models": models, "wall_s": wall_s,
            "scenarios": [asdict(r) for r in results]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")


def _revision() -> str:
    """The commit this ran at, and whether the working tree had other changes."""
    here = Path(__file__).parent
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=here).stdout
    commit = git("rev-parse", "--short", "HEAD").strip() or "no git commit"
    return commit + (" plus uncommitted changes" if git("status", "--porcelain", "-uno") else "")


def run_cli(
    names: Sequence[str], out: Path | None, models: ModelChoice | None, command: str
) -> int:
    start = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="specmesh-faults-"))
    label = f"on {models.target}" if models else "on a tiny random Llama pair (runtime.tiny)"
    results = run_report(names, models or tiny_pair(), log_dir)
    wall_s = time.monotonic() - start
    if out is not None:
        write_report(results, out, command, label, wall_s)
    print(markdown_table(results))
    print(f"\n{len(results)} scenarios in {wall_s:.0f} s; service logs in {log_dir}"
          + (f"; wrote {out}/table.md, results.json" if out else ""))  # fmt: skip
    return 1 if any(r.problems() for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specmesh.bench.faults", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: "
                   f"all: {','.join(SCENARIOS)})")  # fmt: skip
    p.add_argument("--out", type=Path, metavar="DIR", help="write DIR/results.json, DIR/table.md")
    p.add_argument("--target-model", metavar="DIR", help="default: a tiny random pair")
    p.add_argument("--draft-model", metavar="DIR", help="its EAGLE-3 draft")
    args = p.parse_args(argv)
    if (args.target_model is None) != (args.draft_model is None):
        p.error("--target-model and --draft-model go together")
    models = None
    if args.target_model is not None:
        models = ModelChoice(args.target_model, args.draft_model, "eagle3")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SCENARIOS]:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    command = "python -m specmesh.bench.faults " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    return run_cli(names, args.out, models, command.strip())


if __name__ == "__main__":
    sys.exit(main())
