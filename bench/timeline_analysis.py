"""Reading a round timeline (`bench.round_timeline`): the stages' spans of every process, and on
a GPU the kernels, copies and runtime calls of a `torch.profiler` trace, put on one clock and
split per round.

A round is a router ``round`` span. Every other span belongs to the round it starts in (all
processes share the monotonic clock); a kernel belongs to the innermost span, on the thread
that launched it, that was open at its launch (a CUDA graph's kernels to its replay's launch).
The profiler names threads its own way: each of its threads is matched to the spans' thread
whose stage was most often open, innermost, at its calls. Per round and stage: calls, host time, device time and kernels launched, graph launches, and the
syncs the host waited on (stream / device / event synchronizations and device-to-host copies)
with the time it waited. Per round: wall time and the device's busy time (the union of its
kernels and copies), the rest being the device idle while the host works or waits.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmesh.bench.timeline_hops import format_hops, hop_segments

ROUND = "round"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")
GRAPH_LAUNCH = "cudaGraphLaunch"
ANCHOR_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: the clock anchor of a trace
NO_STAGE = "(outside any stage)"


@dataclass(frozen=True)
class Span:
    process: str
    label: str
    tid: int
    start: int  # ns, monotonic
    end: int


@dataclass(frozen=True)
class Call:
    """A CUDA runtime call: its name, thread, interval (ns, monotonic) and correlation id."""

    name: str
    tid: int
    start: int
    end: int
    correlation: int


@dataclass
class DeviceTrace:
    """One process's device activity on the monotonic clock."""

    process: str
    kernels: list[tuple[int, int, int]] = field(default_factory=list)  # start, end, correlation
    calls: dict[int, Call] = field(default_factory=dict)  # by correlation
    d2h: set[int] = field(default_factory=set)  # correlations of device-to-host copies


def load_trace(path: Path, process: str, anchor_ns: int) -> DeviceTrace:
    """A chrome trace written by `torch.profiler` (kineto) whose first ``spin_kernel`` was
    launched at ``anchor_ns`` on the monotonic clock."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and "correlation" in e.get("args", {})]
    by_corr = {e["args"]["correlation"]: e for e in xs if e.get("cat") == "cuda_runtime"}
    spin = next((e for e in xs if e.get("cat") == "kernel" and ANCHOR_KERNEL in e["name"]), None)
    if spin is None or spin["args"]["correlation"] not in by_corr:
        raise ValueError(f"{path}: no anchor kernel ({ANCHOR_KERNEL}) with its launch")
    offset = anchor_ns - _ns(by_corr[spin["args"]["correlation"]]["ts"])
    trace = DeviceTrace(process)
    for e in xs:
        start, corr = _ns(e["ts"]) + offset, e["args"]["correlation"]
        end = start + _ns(e.get("dur", 0))
        if e.get("cat") == "cuda_runtime":
            trace.calls[corr] = Call(e["name"], int(e["tid"]) & 0xFFFFFFFF, start, end, corr)
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            trace.kernels.append((start, end, corr))
            if "DtoH" in e["name"]:
                trace.d2h.add(corr)
    trace.kernels.sort()
    return trace


def _ns(us: float | str) -> int:
    return round(float(us) * 1000)


@dataclass
class StageTotals:
    calls: int = 0
    host_ns: int = 0
    device_ns: int = 0
    kernels: int = 0
    graph_launches: int = 0
    syncs: int = 0
    sync_ns: int = 0


class Timeline:
    """Spans and device traces of one run, split per round (see the module docstring)."""

    def __init__(self, spans: list[Span], traces: list[DeviceTrace] = ()) -> None:
        rounds = sorted((s.start, s.end) for s in spans if s.label == ROUND)
        if not rounds:
            raise ValueError("no round span: nothing to split")
        self.rounds, self.spans = rounds, spans
        self._starts = [r[0] for r in rounds]
        self.totals: dict[tuple[str, str], StageTotals] = defaultdict(StageTotals)
        self._by_thread: dict[tuple[str, int], list[Span]] = defaultdict(list)
        for s in spans:
            if s.label != ROUND and self.round_of(s.start) is not None:
                t = self.totals[(s.process, s.label)]
                t.calls, t.host_ns = t.calls + 1, t.host_ns + (s.end - s.start)
            self._by_thread[(s.process, s.tid)].append(s)
        for thread in self._by_thread.values():
            thread.sort(key=lambda s: s.start)
        self._thread_starts = {k: [s.start for s in v] for k, v in self._by_thread.items()}
        self.busy_ns = [0] * len(rounds)
        self.by_time_only = 0  # device calls of a thread no stage was seen to make
        for trace in traces:
            self._add_device(trace)
        self._add_busy([k for t in traces for k in t.kernels])

    def round_of(self, t: int) -> int | None:
        i = bisect.bisect_right(self._starts, t) - 1
        return i if i >= 0 and t <= self.rounds[i][1] else None

    def innermost(self, process: str, tid: int, t: int) -> str:
        """The label of the innermost stage open at ``t`` on that thread (a thread of the
        spans; `_thread_map` names the trace's threads so)."""
        span = self._open_at(process, [tid], t)
        return NO_STAGE if span is None else span.label

    def _open_at(self, process: str, threads: list[int], t: int) -> Span | None:
        """The latest-opened stage of those threads still open at ``t``."""
        best: Span | None = None
        for thread in threads:
            spans = self._by_thread.get((process, thread), [])
            i = bisect.bisect_right(self._thread_starts.get((process, thread), []), t)
            for s in reversed(spans[:i]):
                if s.end >= t and s.label != ROUND:
                    best = s if best is None or s.start > best.start else best
                    break
        return best

    def _thread_map(self, trace: DeviceTrace) -> dict[int, int]:
        """The spans' thread of each of the trace's threads. The profiler numbers threads its
        own way, so each of its threads is the one whose stage was most often the latest
        opened (of any thread) at its calls: the stage that made them."""
        threads = [k[1] for k in self._by_thread if k[0] == trace.process]
        votes: dict[int, Counter] = defaultdict(Counter)
        for call in trace.calls.values():
            if self.round_of(call.start) is not None:
                span = self._open_at(trace.process, threads, call.start)
                if span is not None:
                    votes[call.tid][span.tid] += 1
        return {tid: c.most_common(1)[0][0] for tid, c in votes.items()}

    def _add_device(self, trace: DeviceTrace) -> None:
        names = self._thread_map(trace)
        stage_of = {}
        for corr, call in trace.calls.items():
            if self.round_of(call.start) is None:
                continue
            self.by_time_only += call.tid not in names
            stage_of[corr] = self.innermost(trace.process, names.get(call.tid, -1), call.start)
        for start, end, corr in trace.kernels:
            if corr in stage_of:
                t = self.totals[(trace.process, stage_of[corr])]
                t.device_ns, t.kernels = t.device_ns + (end - start), t.kernels + 1
        for corr, stage in stage_of.items():
            call, t = trace.calls[corr], self.totals[(trace.process, stage)]
            t.graph_launches += call.name == GRAPH_LAUNCH
            if call.name in SYNC_CALLS or (call.name in COPY_CALLS and corr in trace.d2h):
                t.syncs, t.sync_ns = t.syncs + 1, t.sync_ns + (call.end - call.start)

    def _add_busy(self, kernels: list[tuple[int, int, int]]) -> None:
        """The device's busy time per round: the union of every kernel and copy, clipped."""
        kernels = sorted(kernels)
        starts = [k[0] for k in kernels]
        longest = max((e - s for s, e, _ in kernels), default=0)
        for i, (lo, hi) in enumerate(self.rounds):
            near = kernels[
                bisect.bisect_left(starts, lo - longest) : bisect.bisect_left(starts, hi)
            ]
            clipped = [(max(s, lo), min(e, hi)) for s, e, _ in near if e > lo]
            busy, reach = 0, lo
            for s, e in clipped:
                if e > reach:
                    busy += e - max(s, reach)
                    reach = e
            self.busy_ns[i] = busy

    def hops(self) -> dict[str, float]:
        """Per round, what a router's call to a service took beyond the service's own handling
        of it (the wire, serialization, queues): ``router.<x>_call - <service>.rpc_batch``."""
        out = {}
        n = len(self.rounds)
        for call, service in (("router.draft_call", "draft"), ("router.verify_call", "target")):
            outer = self.totals.get(("router", call))
            inner = self.totals.get((service, f"{service}.rpc_batch"))
            if outer and inner:
                out[f"{call} beyond {service}.rpc_batch"] = (
                    (outer.host_ns - inner.host_ns) / 1e6 / n
                )
        # The router's waits on its streams beyond the services' steps (a step's own handling,
        # worker hand-off included): the wire, the streams' reading and both event loops.
        waits = self.totals.get(("router", "router.stream_wait"))
        steps = [self.totals.get((p, "service.step")) for p in ("draft", "target")]
        if waits and all(steps):
            beyond = waits.host_ns - sum(t.host_ns for t in steps)
            out["router.stream_wait beyond the services' steps"] = beyond / 1e6 / n
        return out

    def summary(self, tokens_per_round: float | None = None) -> dict[str, Any]:
        n = len(self.rounds)
        wall = [(e - s) / 1e6 for s, e in self.rounds]
        per_round = lambda ns: ns / 1e6 / n
        stages = [
            {"process": p, "stage": label, "calls_per_round": t.calls / n,
             "host_ms_per_round": per_round(t.host_ns), "device_ms_per_round": per_round(t.device_ns),
             "kernels_per_round": t.kernels / n, "graph_launches_per_round": t.graph_launches / n,
             "syncs_per_round": t.syncs / n, "sync_wait_ms_per_round": per_round(t.sync_ns)}
            for (p, label), t in sorted(self.totals.items())
        ]  # fmt: skip
        return {
            "rounds": n,
            "round_ms": {"min": min(wall), "median": statistics.median(wall), "max": max(wall),
                         "mean": statistics.fmean(wall)},
            "device_busy_ms_per_round": sum(self.busy_ns) / 1e6 / n,
            "device_calls_of_unmatched_threads": self.by_time_only,
            "hops": self.hops(),
            "hop_segments": hop_segments(self.spans, lambda t: self.round_of(t) is not None),
            "tokens_per_round": tokens_per_round,
            "stages": stages,
        }  # fmt: skip


def format_summary(title: str, summary: dict[str, Any], device: bool) -> str:
    """Markdown: the round line, then one row per (process, stage)."""
    r = summary["round_ms"]
    busy = summary["device_busy_ms_per_round"]
    head = (f"### {title}\n\n{summary['rounds']} rounds, round {r['median']:.2f} ms median "
            f"({r['min']:.2f} - {r['max']:.2f}), mean {r['mean']:.2f} ms")  # fmt: skip
    if summary.get("tokens_per_round"):
        head += f", {summary['tokens_per_round']:.2f} tokens per round"
    if device:
        head += (
            f"; device busy {busy:.2f} ms per round ({100 * busy / r['mean']:.0f} % of the mean)"
        )
    cols = ["process", "stage", "calls", "host ms"]
    cols += ["device ms", "kernels", "graph launches", "syncs", "sync wait ms"] if device else []
    for what, ms in summary.get("hops", {}).items():
        head += f"\n\n- {what}: {ms:.3f} ms per round"
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in summary["stages"]:
        cells = [s["process"], s["stage"], f"{s['calls_per_round']:.1f}", f"{s['host_ms_per_round']:.3f}"]  # fmt: skip
        if device:
            cells += [f"{s['device_ms_per_round']:.3f}", f"{s['kernels_per_round']:.0f}",
                      f"{s['graph_launches_per_round']:.1f}", f"{s['syncs_per_round']:.1f}",
                      f"{s['sync_wait_ms_per_round']:.3f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n\nAll figures per round (means); host ms include nested stages."
    hops = format_hops(summary.get("hop_segments", {}))
    if not hops:
        return text
    return f"{text}\n\nA call, cut where it changes hands (`bench.timeline_hops`):\n\n{hops}"
