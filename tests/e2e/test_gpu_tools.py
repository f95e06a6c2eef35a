"""The GPU measuring tools kept working on CPU: `bench.gpu_speed` in process, as a gRPC cluster
(real target, draft and router processes) and for transformers, on the small synthetic pair
whose acceptance is forced; and `scripts/gpu_check.sh` names its phases."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specmesh.bench.gpu_speed import main as gpu_speed

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("side", ["engine", "cluster", "transformers"])
def test_gpu_speed_measures_every_side(synthetic_pair, tmp_path: Path, side: str) -> None:
    import json

    target, draft = synthetic_pair
    out = tmp_path / "speed.json"
    # the cluster's services get extra flags (a flag they do not take would stop them starting)
    service_args = ["--draft-args=--predraft 2 --predraft-steps 5", "--target-args=--no-run-ahead"]
    flags = {"engine": [], "cluster": ["--cluster", "--num-micro-batches", "1", *service_args],
             "transformers": ["--transformers"]}[side]  # fmt: skip
    argv = ["--target-model", str(target), "--draft-model", str(draft), "--device", "cpu",
            "--dtype", "fp32", "--attention-backend", "torch", "--batch-sizes", "1,2",
            "--repeats", "2", "--max-new-tokens", "8", "--prompt-len", "16", "--out", str(out),
            *flags]  # fmt: skip
    assert gpu_speed(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch_size"], r["mode"]): r for r in result["rows"]}
    modes = ("plain",) if side == "transformers" else ("plain", "speculative")
    assert set(rows) == {(b, m) for b in (1, 2) for m in modes}
    for (_, mode), row in rows.items():
        assert len(row["tokens_per_s_runs"]) == 2 and row["tokens_per_s"]["min"] > 0
        # Forced acceptance: every speculative round emits num_steps + 1 = 6 tokens.
        assert row["accept_len"] == (6.0 if mode == "speculative" else 1.0)
    assert result["num_micro_batches"] == {"engine": 1, "cluster": 1, "transformers": None}[side]
    if side == "cluster":
        assert result["service_args"] == {
            "draft": "--predraft 2 --predraft-steps 5",
            "target": "--no-run-ahead",
        }
    if side != "transformers":
        assert set(result["ratios"]) == {"speculative_vs_plain_b1", "speculative_vs_plain_b2"}


def test_gpu_check_lists_its_phases() -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh")], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2
    for phase in ("env", "tests", "e2e", "roofline", "speed", "cluster", "train"):
        assert f"#     {phase} " in proc.stdout, phase


def test_roofline_rates_the_card_it_runs_on():
    """The nominal bound is the card's own: an H200 is not rated as an H100 (round 5 was)."""
    from specmesh.bench.roofline import nominal_bandwidth_tbs

    assert nominal_bandwidth_tbs("NVIDIA H200") == 4.8
    assert nominal_bandwidth_tbs("NVIDIA H100 80GB HBM3") == 3.35
    assert nominal_bandwidth_tbs("NVIDIA H100 PCIe") == 2.0
    assert nominal_bandwidth_tbs("NVIDIA GeForce RTX 4090") is None
