"""The fault report end to end (`specmesh.bench.faults`, issue 54): two cheap scenarios on one
real cluster of the tiny pair, through the `specmesh bench --faults` flag. The report writes the
command it ran, a table with one row per scenario, and results in which every request was
checked and exact, nothing failed and nothing was held afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmesh.bench.fault_report import COLUMNS
from specmesh.cli.main import main as specmesh

pytestmark = pytest.mark.slow

SCENARIOS = ("hostile-bodies", "draft-stop")


def test_fault_report_runs_two_scenarios(tmp_path: Path, tiny_dir: Path) -> None:
    argv = ["bench", "--faults", ",".join(SCENARIOS), "--out", str(tmp_path)]
    argv += ["--target-model", str(tiny_dir / "target"), "--draft-model", str(tiny_dir / "draft")]
    rc = specmesh(argv)

    out = tmp_path / "faults"
    text = (out / "table.md").read_text()
    assert rc == 0, text
    assert text.splitlines()[2].strip().startswith("python -m specmesh.bench.faults --out")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    assert [len(r) for r in rows] == [len(COLUMNS)] * (2 + len(SCENARIOS))
    assert [r[0].strip("| ") for r in rows[2:]] == list(SCENARIOS)

    results = json.loads((out / "results.json").read_text())["scenarios"]
    for r in results:
        phases = r["phases"].values()
        assert sum(p["num_exact"] for p in phases) == sum(p["num_requests"] for p in phases) > 0
        assert all(not p["failures"] for p in phases) and not r["failures"], r
        assert r["held_after"] == {}, r
    drafted = {r["name"]: [p["num_drafted"] for p in r["phases"].values()] for r in results}
    assert drafted["hostile-bodies"][0] > 0  # the cluster speculated
