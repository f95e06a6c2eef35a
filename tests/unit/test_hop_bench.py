"""`bench.hop`'s bookkeeping and `bench.hop_floor`, the gRPC floor it reports beside its ratios:
a real echo server process and a `grpc.aio` client (no timing is asserted beyond its order)."""

from __future__ import annotations

import os

import pytest

from specmesh.bench import hop, hop_floor


def test_the_floor_is_measured_against_a_real_echo_server() -> None:
    (small, large) = hop_floor.measure((16, 2048), count=20)
    for f, size in ((small, 16), (large, 2048)):
        assert f["bytes"] == size and f["count"] == 20
        assert 0 < f["p10_ms"] <= f["round_trip_ms"] <= f["p90_ms"]
    assert "| 2048 |" in hop_floor.format_floor([small, large])


def _config(label: str, ms: float, tok_s: float) -> dict:
    return {"label": label, "ms_per_round": {"median": ms}, "ms_per_round_runs": [ms],
            "tokens_per_s_runs": [tok_s]}  # fmt: skip


def test_each_mode_gets_its_floor_and_best_sequential_ratio() -> None:
    configs = [_config("inprocess plain", 1.0, 900.0), _config("cluster plain", 1.2, 750.0),
               _config("inprocess eagle3", 3.0, 300.0), _config("cluster eagle3", 4.0, 225.0)]  # fmt: skip
    floor = [{"round_trip_ms": 0.25}, {"round_trip_ms": 0.5}]
    by_mode = {c["mode"]: c for c in hop.with_floor(hop.compare(configs), configs, floor)}
    assert set(by_mode) == {"plain", "eagle3"}  # modes whose configurations did not run: none
    assert by_mode["plain"]["floor_ms_per_round"] == pytest.approx(0.25)  # the target's trip
    assert by_mode["plain"]["best_sequential_ratio"] == pytest.approx(1.0 / 1.25)
    assert by_mode["eagle3"]["floor_ms_per_round"] == pytest.approx(0.75)  # target, then draft
    assert by_mode["eagle3"]["best_sequential_ratio"] == pytest.approx(3.0 / 3.75)
    assert by_mode["eagle3"]["ratio"] == pytest.approx(0.75)


@pytest.mark.parametrize("only", ["plain", "eagle3"])
def test_only_runs_one_kind(only: str) -> None:
    chosen = hop.plan(2, only)
    assert {c.kind for c in chosen} == {only}
    assert {c.run.backend for c in chosen} == {"inprocess", "cluster"}
    assert len(hop.plan(2, "plain")) + len(hop.plan(2, "eagle3")) == len(hop.plan(2))


def test_inline_step_ms_adds_one_eagle3_cluster_whose_services_get_it() -> None:
    base, inline = hop.plan(2, "eagle3"), hop.plan(2, "eagle3", inline_step_ms=20)
    assert inline[: len(base)] == base and len(inline) == len(base) + 1
    extra = inline[-1]
    assert extra.run.backend == "cluster" and extra.inline_step_ms == 20
    assert extra.label == "cluster eagle3 --inline-step-ms 20"
    assert len({c.label for c in inline}) == len(inline)  # its runs are reported apart


def test_each_mode_gets_the_turn_taking_ratio_of_its_in_process_round() -> None:
    turns = {"ratio": 0.57, "ratio_min": 0.4, "ratio_max": 0.6}
    configs = [_config("inprocess plain", 1.0, 900.0), _config("cluster plain", 1.2, 750.0),
               _config("cluster plain --no-run-ahead", 1.3, 700.0),
               _config("inprocess eagle3", 3.0, 300.0) | {"turns": turns},
               _config("cluster eagle3", 4.0, 225.0)]  # fmt: skip
    floor = [{"round_trip_ms": 0.25}, {"round_trip_ms": 0.5}]
    comparisons = hop.with_floor(hop.compare(configs), configs, floor)
    by_mode = {c["mode"]: c for c in comparisons}
    assert by_mode["eagle3"]["turns"] is turns  # beside the in-process run it was sized to
    assert by_mode["plain"]["turns"] is None is by_mode["plain --no-run-ahead"]["turns"]
    table = hop.format_tables([{**c, "tokens_per_s": 1.0, "tokens_per_s_min": 1.0,
                                "tokens_per_s_max": 1.0, "mean_accept_len": 1.0,
                                "ttft_s_mean": 0.0, "ms_per_round": {"median": 1.0, "min": 1.0,
                                "max": 1.0}} for c in configs], comparisons)  # fmt: skip
    assert "| 0.57 (0.40 - 0.60) |" in table and "taking turns, no wire" in table
    assert table.count("| - |") == 2  # plain's two modes: not measured


def test_two_processes_take_turns_against_one() -> None:
    from specmesh.bench import alternation

    pin = {0, 1} <= os.sched_getaffinity(0)
    placed = os.sched_getaffinity(0)
    out = alternation.measure(layers=1, rounds=5, repeats=1, pin=pin)
    assert os.sched_getaffinity(0) == placed  # the driver is back where it was
    assert out["one_process_ms"]["min"] > 0 and out["two_processes_ms"]["min"] > 0
    assert len(out["ratio_runs"]) == 1 and out["ratio_runs"][0] > 0
    assert "| one / two |" in alternation.format_alternation(out)
    assert alternation.layers_for(200.0) > alternation.layers_for(0.01) == 1
    assert alternation.sized(200.0, pin) > 1
