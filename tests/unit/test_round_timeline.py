"""`bench.round_timeline`: the round split into stages, from spans and (on a GPU) a profiler
trace. The trace reading is checked on a hand-written chrome trace in kineto's layout; the
spans on a real in-process run of the tiny pair."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from specmesh.bench.timeline_analysis import NO_STAGE, Span, Timeline, load_trace
from specmesh.bench.timeline_hops import SEGMENTS, format_hops, hop_segments

MS = 1_000_000  # ns


def _x(cat: str, name: str, ts_us: float, dur_us: float, corr: int, tid: int = 1007) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "tid": tid,
            "args": {"correlation": corr}}  # fmt: skip


def _trace(tmp_path: Path) -> Path:
    """Kineto's times and thread numbers are its own (here: 5,000 us behind the spans' clock,
    threads 1007 and 99 for the spans' 7 and 8); the anchor kernel is launched at monotonic 0."""
    base = -5000.0
    events = [
        _x("cuda_runtime", "cudaLaunchKernel", base + 0, 1, 1),
        _x("kernel", "void spin_kernel(long)", base + 2, 3, 1, tid=1),
        # round 1 (10-20 ms): a graph launch inside the verify, a device-to-host copy after it
        _x("cuda_runtime", "cudaGraphLaunch", base + 11_000, 10, 2),
        _x("kernel", "gemm", base + 11_100, 4_000, 2, tid=1),
        _x("kernel", "attn", base + 15_100, 1_000, 2, tid=1),
        _x("cuda_runtime", "cudaMemcpyAsync", base + 12_000, 4_200, 3),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", base + 16_150, 50, 3, tid=1),
        # another thread: the profiler's threads are matched to the spans' by their stages
        _x("cuda_runtime", "cudaLaunchKernel", base + 18_000, 5, 4, tid=99),
        _x("kernel", "topk", base + 18_010, 500, 4, tid=1),
        # outside any round: not counted
        _x("cuda_runtime", "cudaLaunchKernel", base + 30_000, 5, 5),
        _x("kernel", "late", base + 30_010, 500, 5, tid=1),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_attribution_and_busy_time(tmp_path: Path) -> None:
    spans = [
        Span("p", "round", 1, 10 * MS, 20 * MS),
        Span("p", "target.verify", 7, 10 * MS + 500_000, 17 * MS),
        Span("p", "graph_replay", 7, 10 * MS + 900_000, 11 * MS + 100_000),
        Span("p", "draft.propose", 8, 17 * MS + 500_000, 19 * MS),
    ]
    device = load_trace(_trace(tmp_path), "p", anchor_ns=0)
    timeline = Timeline(spans, [device])
    s = {row["stage"]: row for row in timeline.summary(2.0)["stages"]}
    replay = s["graph_replay"]
    assert replay["graph_launches_per_round"] == 1 and replay["kernels_per_round"] == 2
    assert replay["device_ms_per_round"] == pytest.approx(5.0)
    verify = s["target.verify"]  # the copy waited on: a sync, and its device time
    assert verify["syncs_per_round"] == 1 and verify["sync_wait_ms_per_round"] == pytest.approx(4.2)
    assert verify["device_ms_per_round"] == pytest.approx(0.05)
    assert s["draft.propose"]["kernels_per_round"] == 1  # its thread, not the verify's
    assert timeline.by_time_only == 0
    assert NO_STAGE not in s
    summary = timeline.summary()
    assert summary["rounds"] == 1 and summary["round_ms"]["median"] == pytest.approx(10.0)
    # busy: 4.0 + 1.0 (contiguous) + 0.05 + 0.5, the late kernel outside
    assert summary["device_busy_ms_per_round"] == pytest.approx(5.55)


def test_a_trace_without_its_anchor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("kernel", "gemm", 0, 1, 1)]}))
    with pytest.raises(ValueError, match="anchor"):
        load_trace(path, "p", 0)


def test_hops_are_the_calls_beyond_the_services(tmp_path: Path) -> None:
    spans = [
        Span("router", "round", 1, 0, 10 * MS),
        Span("router", "router.verify_call", 1, 1 * MS, 6 * MS),
        Span("target", "target.rpc_batch", 2, 2 * MS, 5 * MS),
    ]
    hops = Timeline(spans).summary()["hops"]
    assert hops == {"router.verify_call beyond target.rpc_batch": pytest.approx(2.0)}


def test_a_call_is_cut_where_it_changes_hands() -> None:
    """Router write, the service's read, its step (worker hand-offs around the batch), the
    router's read: eight segments that add up to the call; a call missing a span is left out."""
    us = 1000
    spans = [
        Span("router", "router.verify_call", 1, 0, 1000 * us),
        Span("router", "router.stream_write", 1, 40 * us, 60 * us),
        Span("target", "wire.arrive", 2, 100 * us, 110 * us),  # a first chunk
        Span("target", "wire.arrive", 2, 200 * us, 300 * us),  # the batch whole
        Span("target", "service.step", 2, 320 * us, 900 * us),
        Span("target", "target.rpc_batch", 3, 400 * us, 850 * us),
        Span("router", "wire.arrive", 1, 940 * us, 960 * us),
        # a draft call whose service never read it: not counted
        Span("router", "router.draft_call", 1, 2000 * us, 3000 * us),
        Span("router", "router.stream_write", 1, 2010 * us, 2020 * us),
    ]
    hops = hop_segments(spans)
    assert set(hops) == {"router.verify_call"}
    got = hops["router.verify_call"]
    ms = [got[s] for s in SEGMENTS]
    assert ms == pytest.approx([0.04, 0.26, 0.02, 0.08, 0.45, 0.05, 0.06, 0.04])
    assert sum(ms) == pytest.approx(1.0) and got["calls"] == 1
    assert "| hand-off in | 0.080 |" in format_hops(hops)


def test_in_process_run_on_the_tiny_pair(tmp_path: Path) -> None:
    from specmesh.bench.round_timeline import main

    assert main(["--batch-sizes", "2", "--max-new-tokens", "8", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "timeline.json").read_text())["results"]["in-process"]["b2"]
    summary = result["spans_only"]
    stages = {row["stage"]: row for row in summary["stages"]}
    assert summary["rounds"] >= 3
    for stage in ("router.draft_call", "router.verify_call", "draft.extend", "draft.propose",
                  "target.verify", "target.accept"):  # fmt: skip
        assert stages[stage]["calls_per_round"] > 0 and stages[stage]["host_ms_per_round"] > 0
    # a stage runs inside its round: no stage takes longer per round than the round itself
    assert max(r["host_ms_per_round"] for r in summary["stages"]) <= summary["round_ms"]["mean"]
    assert "### in-process, b2, spans only" in (tmp_path / "timeline.md").read_text()


def test_cluster_run_times_every_process(tmp_path: Path) -> None:
    """Through target, draft and router processes: each service's stages inside the router's
    rounds, and what each call took beyond the service's handling of it."""
    from specmesh.bench.round_timeline import main

    args = ["--batch-sizes", "1", "--max-new-tokens", "8", "--cluster", "--no-in-process"]
    pin = len(os.sched_getaffinity(0)) >= 2 and {0, 1} <= os.sched_getaffinity(0)
    placed = os.sched_getaffinity(0)
    assert main([*args, *(["--pin"] if pin else []), "--out", str(tmp_path)]) == 0
    assert os.sched_getaffinity(0) == placed  # the run gave this process its cores back
    summary = json.loads((tmp_path / "timeline.json").read_text())["results"]["cluster"]["b1"]
    summary = summary["spans_only"]
    if pin:  # one core per device: the target on 0, the draft and the router on 1
        assert summary["cpus"] == {"target": [0], "draft": [1], "router": [1]}
    seen = {(row["process"], row["stage"]) for row in summary["stages"]}
    assert {("draft", "draft.rpc_batch"), ("target", "target.rpc_batch"),
            ("router", "router.verify_call"), ("draft", "draft.propose")} <= seen  # fmt: skip
    assert set(summary["hops"]) == {"router.draft_call beyond draft.rpc_batch",
                                    "router.verify_call beyond target.rpc_batch",
                                    "router.stream_wait beyond the services' steps"}  # fmt: skip
    assert all(math.isfinite(ms) for ms in summary["hops"].values())  # signs are timing's
    assert {("router", "router.stream_write"), ("draft", "service.step"),
            ("target", "service.answer")} <= seen  # fmt: skip
    calls = {row["stage"]: row for row in summary["stages"] if row["process"] == "router"}
    for call in ("router.verify_call", "router.draft_call"):  # every round's call, cut whole
        segments = summary["hop_segments"][call]
        assert segments["calls"] == pytest.approx(
            calls[call]["calls_per_round"] * summary["rounds"]
        )
        assert sum(segments[s] for s in SEGMENTS) == pytest.approx(
            calls[call]["host_ms_per_round"] / calls[call]["calls_per_round"], rel=1e-6
        )
        assert segments["the service's batch"] > 0
