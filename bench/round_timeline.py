"""Where a speculative round's time goes: per round and stage, in process and in each process of
a gRPC cluster, host time, and on a GPU the device work, graph launches and host syncs.

    python -m specmesh.bench.round_timeline [--target-model DIR --draft-model DIR]
        [--device cuda --dtype bf16 --attention-backend triton] [--batch-sizes 1,8]
        [--cluster [--inline-step-ms MS]] [--max-new-tokens 64] [--out DIR]

Without models it builds the near-free tiny pair of `bench.hop` (no download). For each batch
size: a warm-up run, a run with the stages timed (`bench.timeline_spans`: router, draft and
target stages as spans on the monotonic clock), and on a GPU one more under `torch.profiler`
(device activity only: kernels, copies, CUDA runtime calls; `bench.timeline_analysis` puts them
on the spans' clock and gives each kernel to the stage that launched it). ``--cluster`` runs the
same through target, draft and router processes (one router micro-batch, speculation always),
each service timing its own stages inside the same window of requests (`bench.timeline_service`;
on a GPU the services' device traces cover the first batch size only).
Speculation is always on: every round drafts and verifies a full tree.

``--pin`` places each side as `bench.hop --pin` does (one core per device: in process on core
0; the cluster's target on core 0, its draft, router and this process on core 1).

Writes ``OUT/timeline.json`` and ``OUT/timeline.md``; the profiler traces stay in
``OUT/traces``. The profiled run's rounds are slower than the spans-only run's (each kernel
launch is recorded): both round times are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specmesh.bench.timeline_analysis import Span, Timeline, format_summary, load_trace
from specmesh.bench.timeline_service import TimelineSpawn, start_device_profile, stop_device_profile
from specmesh.bench.timeline_spans import Spans, install
from specmesh.protocol.config import SpecParams

IN_PROCESS = "in-process"


def _prompts(target: str, n: int, prompt_len: int) -> list[list[int]]:
    from specmesh.bench.workloads import load_workload
    from specmesh.router.tokenizer import load_tokenizer

    return load_workload("code", load_tokenizer(target), n, prompt_len).prompts


def in_process(args: argparse.Namespace, spec: SpecParams, traces: Path) -> dict[str, Any]:
    """Spans-only and (on a GPU) profiled timelines of the in-process engine, per batch size."""
    from specmesh.bench.gpu_speed import engine_runner

    _cpus(args, IN_PROCESS)
    spans = Spans()
    install(spans)
    cfg = SimpleNamespace(**vars(args), num_micro_batches=1)
    run = engine_runner(cfg, spec)
    prompts = _prompts(args.target_model, max(args.sizes), args.prompt_len)
    out = {}
    for b in args.sizes:
        run(prompts[:b], True)  # warm-up at this size
        spans.on = True
        _, _, accept = run(prompts[:b], True)
        spans.on = False
        rows = _kept(spans.take(), traces / f"{IN_PROCESS}-b{b}.spans.json")
        out[f"b{b}"] = {"spans_only": Timeline(rows).summary(accept)}
        if args.device == "cuda":
            path = traces / f"{IN_PROCESS}-b{b}.trace.json"
            prof, anchor = start_device_profile()
            spans.on = True
            _, _, accept = run(prompts[:b], True)
            spans.on = False
            stop_device_profile(prof, path)
            rows = _kept(spans.take(), traces / f"{IN_PROCESS}-b{b}-profiled.spans.json", anchor)
            out[f"b{b}"]["profiled"] = _with_devices(rows, [(path, IN_PROCESS, anchor)], accept)
    return out


def _kept(rows: list[tuple], path: Path, anchor_ns: int = 0) -> list[Span]:
    """The spans as `Span`s, also written to ``path`` (with the trace's anchor) for a later
    reading of the same run."""
    path.write_text(json.dumps({"process": IN_PROCESS, "anchor_ns": anchor_ns, "spans": rows}))
    return [Span(IN_PROCESS, *r) for r in rows]


def _cpus(args: argparse.Namespace, side: str) -> dict[str, list[int]]:
    """``--pin``: `bench.hop`'s placement (this process is the driver; its torch threads are a
    cluster model service's); nothing without it."""
    from specmesh.bench.worker import ONE_DEVICE, TWO_DEVICES
    from specmesh.cluster import model_threads

    cpus = {} if not args.pin else TWO_DEVICES if side == "cluster" else ONE_DEVICE
    if "driver" in cpus:
        os.sched_setaffinity(0, cpus["driver"])
        torch.set_num_threads(model_threads(2))
    return cpus


def cluster(args: argparse.Namespace, spec: SpecParams, traces: Path) -> dict[str, Any]:
    return asyncio.run(_cluster(args, spec, traces))


async def _cluster(args: argparse.Namespace, spec: SpecParams, traces: Path) -> dict[str, Any]:
    from specmesh.bench.runners import RunSpec
    from specmesh.bench.stacks import local_deployment
    from specmesh.defaults import ModelChoice

    models = ModelChoice(args.target_model, args.draft_model, args.draft_kind)
    runtime = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend,
               "inline_step_ms": args.inline_step_ms}  # fmt: skip
    router_args = ["--max-batch-size", str(max(args.sizes)), "--num-micro-batches", "1"]
    router_args += ["--shared-memory"] if args.shared_memory else []
    spawn = TimelineSpawn(
        traces, "cluster", device=args.device == "cuda", cpus=_cpus(args, "cluster")
    )
    prompts = _prompts(args.target_model, max(args.sizes), args.prompt_len)
    out = {}
    async with local_deployment(models, spec, runtime, "always", router_args, spawn=spawn) as c:
        for b in args.sizes:
            rs = RunSpec("cluster", "code", b, 0.0, spec, args.max_new_tokens, b, args.dtype,
                         args.draft_kind)  # fmt: skip
            await c.run(rs, prompts[:b])  # warm-up at this size
            await spawn.window("open", ".open")
            res = await c.run(rs, prompts[:b])
            await spawn.window("close", ".json")
            results = spawn.results()  # the services' profiles cover their first window only
            kind = "profiled" if any(r.get("trace") for r in results) else "spans_only"
            out[f"b{b}"] = {kind: _cluster_timeline(results, res["mean_accept_len"])}
            for name in traces.glob("cluster-*.json"):  # keep each size's spans and traces
                name.rename(name.with_name(f"b{b}-{name.name}"))
    return out


def _cluster_timeline(results: list[dict[str, Any]], accept: float) -> dict[str, Any]:
    spans = [Span(r["process"], *s) for r in results for s in r["spans"]]
    traces = [(Path(r["trace"]), r["process"], r["anchor_ns"]) for r in results if r.get("trace")]
    errors = {r["process"]: r["error"] for r in results if r.get("error")}
    cpus = {r["process"]: r["cpus"] for r in results if "cpus" in r}  # `--pin` places them
    summary = _with_devices(spans, traces, accept) | {"cpus": cpus}
    return summary | ({"service_errors": errors} if errors else {})


def _with_devices(spans: list[Span], traces: list[tuple], accept: float) -> dict[str, Any]:
    """The timeline with the device traces; without them (and why) if one cannot be read."""
    try:
        devices = [load_trace(path, process, anchor) for path, process, anchor in traces]
    except (ValueError, KeyError, OSError) as e:
        return Timeline(spans).summary(accept) | {"device_error": repr(e)}
    return Timeline(spans, devices).summary(accept)


def report(results: dict[str, Any], device: bool) -> str:
    parts = []
    for side, by_size in results.items():
        if not isinstance(by_size, dict):
            continue
        for size, kinds in by_size.items():
            for kind, summary in kinds.items():
                parts.append(format_summary(f"{side}, {size}, {kind.replace('_', ' ')}", summary,
                                            device and kind == "profiled"))  # fmt: skip
    return "\n\n".join(parts)


def _write(out: Path, args: argparse.Namespace, results: dict[str, Any], started: float) -> str:
    text = report(results, args.device == "cuda")
    meta = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "target": args.target_model, "draft": args.draft_model,
            "dtype": args.dtype, "attention_backend": args.attention_backend,
            "cuda_graph": not args.disable_cuda_graph, "spec": args.spec,
            "max_new_tokens": args.max_new_tokens, "inline_step_ms": args.inline_step_ms,
            "shared_memory": args.shared_memory,
            "duration_s": time.time() - started}  # fmt: skip
    (out / "timeline.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "timeline.md").write_text(f"{json.dumps(meta)}\n\n{text}\n")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.round_timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target-model", help="default: the tiny pair of bench.hop, built here")
    p.add_argument("--draft-model")
    p.add_argument("--draft-kind", default="eagle3")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument(
        "--attention-backend", default=None, help="default: triton on cuda, torch on cpu"
    )
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--spec", default="5,4,8", help="num_steps,topk,num_draft_tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--cluster", action="store_true", help="also through a gRPC cluster")
    p.add_argument("--no-in-process", action="store_true", help="only the cluster")
    p.add_argument("--inline-step-ms", type=float, metavar="MS",
                   help="the cluster's services given --inline-step-ms MS (default: theirs)")  # fmt: skip
    p.add_argument("--shared-memory", action="store_true",
                   help="the cluster's feature rows through shared memory (router flag)")  # fmt: skip
    p.add_argument("--pin", action="store_true",
                   help="one core per device, as bench.hop --pin places each side")  # fmt: skip
    p.add_argument("--out", help="default: a new temp dir")
    args = p.parse_args(argv)
    args.sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.attention_backend = args.attention_backend or (
        "triton" if args.device == "cuda" else "torch"
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="specmesh-timeline-"))
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    if args.target_model is None:
        from specmesh.bench.hop import build_models

        models = build_models(out / "models")
        args.target_model, args.draft_model = models.target, models.draft
    spec = SpecParams(*(int(x) for x in args.spec.split(",")))
    started, placed = time.time(), (os.sched_getaffinity(0), torch.get_num_threads())
    try:
        return _run(args, spec, out, traces, started)
    finally:  # `--pin` moved this process (a caller, a test, goes on where it was)
        os.sched_setaffinity(0, placed[0])
        torch.set_num_threads(placed[1])


def _run(
    args: argparse.Namespace, spec: SpecParams, out: Path, traces: Path, started: float
) -> int:
    results: dict[str, Any] = {}
    if not args.no_in_process:
        results[IN_PROCESS] = in_process(args, spec, traces)
        _write(out, args, results, started)  # kept should the cluster run not finish
    if args.cluster:
        try:
            results["cluster"] = cluster(args, spec, traces)
        except Exception as e:  # the in-process tables are kept and written
            print(f"the cluster run failed: {e!r}", file=sys.stderr)
            results["cluster_error"] = repr(e)
    print(_write(out, args, results, started), f"\nwrote {out / 'timeline.md'}", sep="\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
