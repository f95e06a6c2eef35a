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

Writes OUT/results.json and OUT/table.md (`specmesh.bench.fault_report`); a scenario that
raises is a row saying so, and the next one starts a fresh cluster. Exits 1 if any output was
wrong, any request failed, the fault's own traffic got a wrong answer, anything was held
afterwards or a scenario did not run to its end.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from specmesh.bench.fault_cluster import COUNTERS, Cluster, Load, Req
from specmesh.bench.fault_report import (
    PHASES,
    ScenarioResult,
    markdown_table,
    summarize,
    write_report,
)
from specmesh.bench.fault_scenarios import SCENARIOS, FaultContext, Scenario, standard
from specmesh.defaults import ModelChoice, cache_dir
from specmesh.protocol.sampling import SamplingParams


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
            s, start = SCENARIOS[name], time.monotonic()
            if cluster is not None and cluster.spec != s.cluster:
                cluster.stop()
                cluster = None
            try:
                if cluster is None:
                    (log_dir / name).mkdir(parents=True, exist_ok=True)
                    cluster = Cluster(s.cluster, models, log_dir / name)
                    log(f"cluster of {s.cluster.num_targets} target(s) ready in {_since(start)}")
                results.append(run_scenario(s, cluster, oracle))
            except Exception as e:  # a broken scenario is a row of the report, not its end
                results.append(not_run_to_its_end(name, start, e))
                if cluster is not None:
                    cluster.stop()
                cluster = None  # the next scenario starts a fresh one
            verdict = "; ".join(results[-1].problems()) or "ok"
            log(f"{name}: {verdict} ({results[-1].wall_s:.0f} s)")
    finally:
        if cluster is not None:
            cluster.stop()
    return results


def not_run_to_its_end(name: str, start: float, e: Exception) -> ScenarioResult:
    """The row of a scenario that raised (a service that did not start again, ...): the error's
    first line and, from a service's log tail, its last."""
    traceback.print_exc()
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    error = f"{type(e).__name__}: {lines[0]}" + (f" … {lines[-1]}" if lines[1:] else "")
    return ScenarioResult(name, "", {}, {}, {}, _seconds(start), error)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _since(start: float) -> str:
    return f"{_seconds(start):.1f} s"


def _seconds(start: float) -> float:
    return time.monotonic() - start


def tiny_pair() -> ModelChoice:
    """A tiny random Llama and its EAGLE-3 draft, made once under $SPECMESH_CACHE/bench."""
    root = cache_dir() / "bench" / "faults-tiny"
    if not (root / "draft" / "config.json").is_file():
        from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

        make_tiny_target(root / "target")
        make_tiny_eagle3(root / "draft", root / "target", draft_vocab_size=200)
    return ModelChoice(str(root / "target"), str(root / "draft"), "eagle3")


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
