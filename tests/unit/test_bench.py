"""``specmesh bench --quick``: every field of results.json is present and sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specmesh.bench import schema
from specmesh.bench.metrics import RequestTrace, accept_per_position, percentile, summarize
from specmesh.bench.probes import CallLog
from specmesh.main import main


def test_acceptance_per_position_counts_rounds_reaching_each_position() -> None:
    # accept_len 1 = only the bonus token; 3 = positions 1 and 2 accepted.
    assert accept_per_position([1, 3, 2, 4], 3) == [0.75, 0.5, 0.25]
    assert accept_per_position([], 3) == []


def test_latency_statistics_from_chunk_times() -> None:
    trace = RequestTrace(submit_s=0.0)
    for at, n in [(1.0, 1), (1.5, 3), (1.5, 0), (2.5, 2)]:
        trace.add_chunk(at, n)
    trace.accept_lens = [3, 2]
    stats = summarize([trace], wall_s=3.0, num_steps=2)
    assert stats["generated_tokens"] == 6 and stats["tokens_per_s"] == 2.0
    assert stats["ttft_s_mean"] == 1.0
    assert stats["itl_s_p50"] == 0.75 and percentile([0.5, 1.0], 99) == pytest.approx(0.995)
    assert stats["tpot_s_mean"] == pytest.approx(1.5 / 5)
    assert stats["mean_accept_len"] == 2.5 and stats["accept_per_position"] == [1.0, 0.5]


def test_busy_time_is_the_union_of_overlapping_calls() -> None:
    log = CallLog({"target": [(0.0, 2.0), (5.0, 6.0)], "draft": [(1.0, 3.0)]})
    assert log.busy_s() == 4.0 and log.total_s("target") == 3.0


def _check(results: dict, backends: set[str]) -> None:
    assert schema.check(results) == []
    assert {c["backend"] for c in results["configs"]} == backends
    for c in results["configs"]:
        assert (
            c["tokens_per_s"] > 0
            and c["generated_tokens"] == c["num_requests"] * c["max_new_tokens"]
        )
        assert 1.0 <= c["mean_accept_len"] <= c["num_steps"] + 1, c["name"]
        assert len(c["accept_per_position"]) == c["num_steps"]
        assert all(0.0 <= a <= 1.0 for a in c["accept_per_position"])
        assert c["ttft_s_mean"] > 0 and 0 <= c["itl_s_p50"] <= c["itl_s_p99"]
        assert (c["bytes_per_token"] > 0) == (c["backend"] in ("grpc", "cluster"))
    for comp in results["comparisons"]:
        assert math.isfinite(comp["ratio"]) and comp["ratio"] > 0
    assert results["comparisons"] and results["goals"]


def test_quick_bench_in_process_and_transformers(tmp_path: Path) -> None:
    assert main(["bench", "--quick", "--no-grpc", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check(results, {"inprocess", "transformers"})
    names = {c["name"] for c in results["comparisons"]}
    assert names == {"speculative_vs_plain", "plain_vs_transformers"}
    assert {g["name"] for g in results["goals"]} >= {"mean_accept_len_code_5_4_8"}
    sweep = [c for c in results["configs"] if c["speculative"] and c["batch_size"] == 1 and c["workload"] == "code" and c["temperature"] == 0]  # fmt: skip
    assert len(sweep) == 5  # the main spec (3, 4, 8) is also a sweep point
    pytest.importorskip("matplotlib")
    assert (tmp_path / "throughput_vs_batch.png").stat().st_size > 0
    assert (tmp_path / "accept_per_position.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_bench_over_grpc(tmp_path: Path) -> None:
    """Target, draft and router as real processes; bytes on the wire are counted."""
    argv = ["bench", "--quick", "--no-transformers", "--no-sweep", "--workloads", "code",
            "--temperatures", "0", "--batch-sizes", "1,2", "--compare-batch-sizes", "1,2",
            "--out", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    _check(results, {"inprocess", "grpc", "cluster"})
    assert {c["name"] for c in results["comparisons"]} >= {"grpc_cluster_vs_inprocess"}


def test_engine_variants_add_graphs_only_where_they_run() -> None:
    from specmesh.bench.suite import engine_variants

    assert engine_variants(("triton", "torch"), "cpu") == ("torch", "triton")
    assert engine_variants(("torch", "triton", "flashinfer"), "cuda:0") == (
        "torch", "triton", "triton+graphs", "flashinfer", "flashinfer+graphs",
    )  # fmt: skip


def test_attention_backend_comparison(tiny_dir: Path, tmp_path: Path) -> None:
    """torch vs triton (interpreted on CPU) engines over one copy of the weights, plain and
    speculative, each divided by torch at the same batch size."""
    argv = ["bench", "--quick", "--no-grpc", "--no-transformers", "--no-sweep",
            "--target-model", str(tiny_dir / "target"), "--draft-model", str(tiny_dir / "draft"),
            "--draft-kind", "eagle3", "--dtype", "fp32", "--workloads", "code",
            "--temperatures", "0", "--batch-sizes", "1", "--compare-batch-sizes", "1",
            "--compare-attention-backends", "triton", "--engine-batch-sizes", "1,2",
            "--max-new-tokens", "3", "--min-requests", "1", "--prompt-len", "8",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check(results, {"inprocess", "engine:torch", "engine:triton"})
    engines = [c for c in results["configs"] if c["backend"].startswith("engine:")]
    assert len(engines) == 2 * 2 * 2  # 2 variants x plain / speculative x batch 1, 2
    got = {(c["name"], c["batch_size"]) for c in results["comparisons"]}
    assert got >= {(f"triton_vs_torch_{m}", b) for m in ("plain", "speculative") for b in (1, 2)}
    shared = {id(s.targets[0].runtime.model) for s in _engine_stacks(tiny_dir)}
    assert len(shared) == 1


def _engine_stacks(tiny_dir: Path) -> list:
    from specmesh.bench.stacks import engine_backends
    from specmesh.defaults import ModelChoice
    from specmesh.draft_service.drafter import SpecParams

    models = ModelChoice(str(tiny_dir / "target"), str(tiny_dir / "draft"), "eagle3")
    runtime = {"dtype": "fp32", "device": "cpu"}
    return list(engine_backends(models, runtime, ("torch", "triton"), SpecParams()).values())
