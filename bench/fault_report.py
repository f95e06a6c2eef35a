"""The fault report's results (`specmesh.bench.faults`): what each phase of a scenario amounts
to (`summarize`), what went wrong in a scenario (`ScenarioResult.problems`), and the table and
files they are written as (`markdown_table`, `write_report`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from specmesh.bench.fault_cluster import DRAFT_SHAPE, ROUTER_FLAGS, Outcome, Req
from specmesh.bench.fault_scenarios import SCENARIOS

PHASES = ("before", "during", "after")


class Expected(Protocol):
    def tokens(self, req: Req) -> list[int]: ...


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
    error: str = ""  # what stopped the scenario (a service that did not start, ...), if anything

    def problems(self) -> list[str]:
        """What went wrong: [] when every request was exact and nothing failed or was held."""
        wrong = [f"error: {self.error}"] if self.error else []
        wrong += [f"{n}: {p.num_requests - p.num_exact} not exact" for n, p in self.phases.items()
                 if p.num_exact < p.num_requests]  # fmt: skip
        wrong += [f"{n}: failed {p.failures}" for n, p in self.phases.items() if p.failures]
        wrong += [f"fault traffic: {self.failures}"] if self.failures else []
        return wrong + ([f"held after: {self.held_after}"] if self.held_after else [])


def summarize(reqs: Sequence[Req], outcomes: Sequence[Outcome], oracle: Expected) -> PhaseSummary:
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


# -- the table -----------------------------------------------------------------------------------
COLUMNS = ("scenario", "fault, recovery, router counters", "requests b / d / a",
           "failures by status", "exact / checked", "drafted b / d / a", "p50 ms b / d / a",
           "p99 ms b / d / a", "held after")  # fmt: skip


def table_row(r: ScenarioResult) -> list[str]:
    if r.error:
        return [r.name, f"**not run to its end**: {r.error}", *["-"] * (len(COLUMNS) - 2)]
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
