"""One benchmark session: plan, run every (configuration, repeat) in a fresh process, assemble
the results document.

    results = {"meta": {...}, "configs": [...], "comparisons": [...], "goals": [...]}

(`bench.schema` lists the keys every entry has.) This process only orchestrates: it loads the
tokenizer to build the prompts and measures nothing itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
import time
from typing import Any

from specmesh.bench import llamacpp
from specmesh.bench.metrics import aggregate
from specmesh.bench.runners import RunSpec
from specmesh.bench.spawn import run_worker
from specmesh.bench.suite import BenchSettings, compare, goals, interleave, plan
from specmesh.bench.worker import ONE_DEVICE, TWO_DEVICES, Job
from specmesh.bench.workloads import load_workload

WORKER_TIMEOUT_S = 1800.0


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    from specmesh.router.tokenizer import load_tokenizer

    s = settings
    s.validate()
    started = time.time()
    runs, skipped = _drop_unavailable(s, plan(s))
    tokenizer = load_tokenizer(s.models.target)
    num_prompts = max(max(r.num_requests for r in runs), 1)
    workloads = {w: load_workload(w, tokenizer, num_prompts, s.prompt_len) for w in s.workloads}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    by_name: dict[str, list[dict[str, Any]]] = {}
    order = interleave(runs, s.repeats)
    for i, (repeat, run) in enumerate(order):
        res = run_side(s, run, workloads[run.workload].prompts, pad) | {"repeat": repeat}
        by_name.setdefault(run.name, []).append(res)
        _progress(i, len(order), res)
    configs = [aggregate(rs) for rs in by_name.values()]
    comparisons = compare(s, configs)
    return {
        "meta": _meta(s, workloads, started, skipped),
        "configs": configs,
        "comparisons": comparisons,
        "goals": goals(comparisons, configs),
    }


def run_side(s: BenchSettings, run: RunSpec, prompts: list[list[int]], pad: int) -> dict:
    """One (configuration, repeat) in a fresh process."""
    if run.backend == "llamacpp":
        job = llamacpp.job(run, s.gguf_dir, s.threads, prompts)
        command = [s.llamacpp_python, str(llamacpp.WORKER)]
        return llamacpp.to_result(run, run_worker(command, job, s.threads, WORKER_TIMEOUT_S))
    draft = s.draft_dirs.get(run.draft_kind) if run.draft_kind else None
    cpus = {} if not s.pin else TWO_DEVICES if run.backend == "cluster" else ONE_DEVICE
    job = Job(run, s.models.target, draft, s.runtime, s.threads, prompts, pad, cpus=cpus,
              draft_args=list(s.cluster_draft_args))  # fmt: skip
    command = [sys.executable, "-m", "specmesh.bench.worker"]
    return run_worker(command, job.to_json(), s.threads, WORKER_TIMEOUT_S)


def _drop_unavailable(s: BenchSettings, runs: list[RunSpec]) -> tuple[list[RunSpec], dict]:
    """The plan without the llama.cpp runs that cannot run; why, per dtype (printed too)."""
    skipped: dict[str, str] = {}
    for dtype in sorted({r.dtype for r in runs if r.backend == "llamacpp"}):
        reason = llamacpp.unavailable(s.llamacpp_python, s.gguf_dir, dtype)
        if reason:
            skipped[f"llamacpp/{dtype}"] = reason
            print(f"[bench] skipping llamacpp/{dtype}: {reason}", file=sys.stderr, flush=True)
    kept = [r for r in runs if f"{r.backend}/{r.dtype}" not in skipped]
    return kept, skipped


def _progress(i: int, n: int, res: dict[str, Any]) -> None:
    print(
        f"[bench {i + 1}/{n} repeat {res['repeat'] + 1}] {res['name']}: "
        f"{res['tokens_per_s']:.1f} tok/s, accept {res['mean_accept_len']:.2f}, pid {res['pid']}",
        file=sys.stderr,
        flush=True,
    )


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _meta(s: BenchSettings, workloads: dict, started: float, skipped: dict) -> dict[str, Any]:
    import torch
    import transformers

    from specmesh.cluster import model_threads

    return {
        "cpu_model": cpu_model(),
        "num_cpus": os.cpu_count(),
        "threads": {
            "per_process": s.threads,
            "how": "OMP/MKL_NUM_THREADS and torch.set_num_threads (llama.cpp: n_threads) in "
            "every measured process, one process per configuration and repeat",
            "cluster": {"target": model_threads(2), "draft": model_threads(2), "router": 1},
        },
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "models": dataclasses.asdict(s.models),
        "workloads": {
            k: {"num_prompts": len(w.prompts), "source": w.source} for k, w in workloads.items()
        },
        "skipped": skipped,
        "settings": {k: v for k, v in dataclasses.asdict(s).items() if k not in ("models",)},
    }
