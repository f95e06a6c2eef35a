"""``specmesh bench``: the plan runs every (configuration, repeat) in a process of its own,
interleaved; the repeat statistics and ratios; ``--quick`` end to end on tiny models (every field
of results.json present and sane; no speed is asserted)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from specmesh.bench import schema
from specmesh.bench.metrics import (
    RequestTrace,
    accept_per_position,
    aggregate,
    percentile,
    ratio_spread,
    spread,
    summarize,
)
from specmesh.bench.probes import CallLog
from specmesh.bench.runners import RunSpec
from specmesh.bench.suite import BenchSettings, Side, comparisons, interleave, plan
from specmesh.cli.main import main
from specmesh.defaults import ModelChoice
from specmesh.protocol.config import SpecParams


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


def test_repeats_are_interleaved_whole_plan_after_whole_plan() -> None:
    a, b, c = (RunSpec(n, "code", 1, 0.0, None, 4, 1) for n in ("inprocess", "transformers", "llamacpp"))  # fmt: skip
    order = interleave([a, b, c], 3)
    assert [(r, run.backend) for r, run in order] == [
        (r, name) for r in range(3) for name in ("inprocess", "transformers", "llamacpp")
    ]


def test_spread_and_ratios_pair_repeat_i_with_repeat_i() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([4.0, 1.0]) == {"min": 1.0, "median": 2.5, "max": 4.0}
    got = ratio_spread([10.0, 30.0, 20.0], [5.0, 10.0, 20.0])
    assert got["ratio"] == 2.0  # median 20 / median 10
    assert got["ratio_runs"] == [2.0, 3.0, 1.0]  # per repeat, not the sorted values
    assert (got["ratio_min"], got["ratio_max"]) == (1.0, 3.0)


def test_aggregate_keeps_the_median_run_and_every_repeat() -> None:
    runs = [{"tokens_per_s": v, "pid": 100 + i, "ttft_s_mean": v / 10} for i, v in enumerate([5.0, 1.0, 3.0, 9.0])]  # fmt: skip
    got = aggregate(runs)
    assert got["tokens_per_s"] == 4.0 and (got["tokens_per_s_min"], got["tokens_per_s_max"]) == (1.0, 9.0)  # fmt: skip
    assert got["tokens_per_s_runs"] == [5.0, 1.0, 3.0, 9.0] and got["pids"] == [100, 101, 102, 103]
    assert got["ttft_s_mean"] == 0.3 and got["repeats"] == 4  # the lower middle run's fields


def test_run_spec_names_and_json_round_trip() -> None:
    spec = SpecParams(5, 4, 8)
    run = RunSpec("transformers", "code", 1, 0.0, spec, 16, 2, "bf16", "ngram")
    assert run.name == "transformers/bf16/code/b1/t0/lookup-7"
    assert RunSpec.from_json(run.to_json()) == run
    assert RunSpec("inprocess", "code", 8, 0.0, spec, 16, 8, "fp32", "eagle3").mode == "eagle3-5-4-8"  # fmt: skip
    with pytest.raises(ValueError, match="draft kind"):
        RunSpec("inprocess", "code", 1, 0.0, None, 16, 1, "fp32", "eagle3")


def test_plan_runs_both_sides_of_each_comparison_back_to_back_per_dtype() -> None:
    s = BenchSettings(
        ModelChoice("t", "d", "eagle3"), SpecParams(5, 4, 8), dtypes=("fp32", "bf16"),
        compare_batch_sizes=(1, 8), sweep=(), workloads=("code",), temperatures=(0.0,),
        batch_sizes=(1,),
    )  # fmt: skip
    s.validate()
    names = [r.name for r in plan(s)]
    assert len(names) == len(set(names))
    for dtype in s.dtypes:
        i = names.index(f"inprocess/{dtype}/code/b8/t0/plain")
        assert names[i + 1] == f"transformers/{dtype}/code/b8/t0/plain"
        i = names.index(f"inprocess/{dtype}/code/b1/t0/ngram-5-4-8")
        assert names[i + 1] == f"transformers/{dtype}/code/b1/t0/lookup-7"
    got = {(c.name, c.denominator) for c in comparisons(s)}
    assert ("standalone_vs_transformers_assisted", Side("transformers", "standalone")) in got
    assert ("eagle3_vs_transformers", Side("transformers")) in got
    assert ("llamacpp_vs_plain", Side("inprocess")) in got


def _check(results: dict, backends: set[str]) -> None:
    assert schema.check(results) == []
    assert {c["backend"] for c in results["configs"]} == backends
    for c in results["configs"]:
        assert c["tokens_per_s_min"] <= c["tokens_per_s"] <= c["tokens_per_s_max"]
        assert c["generated_tokens"] == c["num_requests"] * c["max_new_tokens"]
        assert c["mean_accept_len"] >= 1.0, c["name"]
        assert all(0.0 <= a <= 1.0 for a in c["accept_per_position"])
        assert c["ttft_s_mean"] > 0 and 0 <= c["itl_s_p50"] <= c["itl_s_p99"]
        assert (c["bytes_per_token"] > 0) == (c["backend"] == "cluster")
        assert len(c["pids"]) == c["repeats"] and c["threads"] >= 1
    pids = [p for c in results["configs"] for p in c["pids"]]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids  # a process per run
    for comp in results["comparisons"]:
        assert math.isfinite(comp["ratio"]) and comp["ratio_min"] <= comp["ratio_max"]
    assert results["comparisons"]


def _tiny_args(tiny_dir: Path, out: Path) -> list[str]:
    return [
        "bench", "--quick", "--target-model", str(tiny_dir / "target"),
        "--draft-model", str(tiny_dir / "draft"), "--draft-kind", "eagle3",
        "--max-new-tokens", "4", "--prompt-len", "8", "--out", str(out),
    ]  # fmt: skip


def test_quick_bench_every_side_in_its_own_process(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path / "cache"))  # the standalone draft
    argv = [*_tiny_args(tiny_dir, tmp_path), "--no-cluster", "--repeats", "2"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check(results, {"inprocess", "transformers"})
    modes = {(c["backend"], c["draft_kind"]) for c in results["configs"]}
    assert modes == {
        ("inprocess", None), ("inprocess", "eagle3"), ("inprocess", "ngram"),
        ("inprocess", "standalone"), ("transformers", None), ("transformers", "ngram"),
        ("transformers", "standalone"),
    }  # fmt: skip
    assert all(c["repeats"] == 2 for c in results["configs"])
    assert {c["name"] for c in results["comparisons"]} == {
        "plain_vs_transformers", "eagle3_vs_transformers", "eagle3_vs_plain",
        "ngram_vs_transformers_lookup", "ngram_vs_plain", "standalone_vs_transformers_assisted",
        "standalone_vs_plain", "eagle3_adaptive_vs_transformers", "eagle3_adaptive_vs_plain",
    }  # fmt: skip
    (adaptive,) = [c for c in results["configs"] if c["speculation"] == "adaptive"]
    assert sum(adaptive["planned_tree_sizes"].values()) >= 1  # the policy's choices, counted
    assert "llamacpp/fp32" in results["meta"]["skipped"]  # this interpreter has no llama_cpp
    assert results["meta"]["threads"]["per_process"] >= 1


def test_tiny_deepseek_bench_reports_mla_moe_plain_and_mtp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--tiny-deepseek`: the MLA + MoE checkpoint with its NextN layer is made once under the
    cache and benched plain and with MTP drafting, whose trees get accepted."""
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path / "cache"))
    argv = ["bench", "--quick", "--tiny-deepseek", "--draft-kinds", "mtp", "--no-transformers",
            "--no-cluster", "--max-new-tokens", "16", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    configs = {(c["draft_kind"], c["speculation"]): c for c in results["configs"]}
    assert set(configs) == {(None, "never"), ("mtp", "always"), ("mtp", "adaptive")}
    assert configs["mtp", "always"]["mean_accept_len"] > 1.5
    assert all(c["tokens_per_s"] > 0 for c in configs.values())
    assert (tmp_path / "cache" / "bench" / "tiny-deepseek-v3-nextn" / "config.json").is_file()


@pytest.mark.slow
def test_quick_bench_cluster_side(tiny_dir: Path, tmp_path: Path) -> None:
    """Target, draft and router as real processes, started by the cluster side's worker."""
    argv = [*_tiny_args(tiny_dir, tmp_path), "--draft-kinds", "eagle3", "--no-transformers",
            "--no-llamacpp"]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check(results, {"inprocess", "cluster"})
    names = {c["name"] for c in results["comparisons"]}
    assert names == {"eagle3_vs_plain", "eagle3_adaptive_vs_plain", "cluster_vs_inprocess"}


def test_engine_variants_add_graphs_only_where_they_run() -> None:
    from specmesh.bench.suite import engine_variants

    assert engine_variants(("triton", "torch"), "cpu") == ("torch", "triton")
    assert engine_variants(("torch", "triton", "flashinfer"), "cuda:0") == (
        "torch", "triton", "triton+graphs", "flashinfer", "flashinfer+graphs",
    )  # fmt: skip


def test_attention_backend_comparison(tiny_dir: Path, tmp_path: Path) -> None:
    """torch vs triton (interpreted on CPU) engines, plain and speculative, each divided by torch."""
    argv = [*_tiny_args(tiny_dir, tmp_path), "--draft-kinds", "eagle3", "--no-transformers",
            "--no-cluster", "--no-llamacpp", "--compare-attention-backends", "triton",
            "--engine-batch-sizes", "1"]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    _check(results, {"inprocess", "engine:torch", "engine:triton"})
    engines = [c for c in results["configs"] if c["backend"].startswith("engine:")]
    assert len(engines) == 2 * 2  # 2 variants x plain / speculative at batch 1
    got = {c["name"] for c in results["comparisons"]}
    assert got >= {"triton_vs_torch_plain", "triton_vs_torch_eagle3"}


def test_pin_places_each_side_on_its_cores(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pin``: one thread per process; the cluster's target on core 0 and its draft, router and
    client on core 1, every other side on core 0; ``--predraft N`` reaches the cluster's draft."""
    from specmesh.bench import session
    from specmesh.cli.cmd_bench import settings_from_args
    from specmesh.cli.main import build_parser

    argv = [*_tiny_args(tiny_dir, tiny_dir / "out"), "--pin", "--predraft", "4"]
    s = settings_from_args(build_parser("bench").parse_args(argv))
    assert s.pin and s.threads == 1 and s.cluster_draft_args == ("--predraft", "4")
    jobs = {}
    monkeypatch.setattr(
        session,
        "run_worker",
        lambda cmd, job, threads, timeout: jobs.setdefault(job["run"]["backend"], job),
    )
    for backend in ("cluster", "inprocess"):
        run = RunSpec(backend, "code", 1, 0.0, s.spec, 4, 1, "fp32", "eagle3")
        session.run_side(s, run, [[1, 2, 3]], 0)
    assert jobs["cluster"]["cpus"] == {"target": [0], "draft": [1], "router": [1], "driver": [1]}
    assert jobs["inprocess"]["cpus"] == {"driver": [0]}
    assert jobs["cluster"]["draft_args"] == ["--predraft", "4"]
