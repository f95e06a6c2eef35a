"""One benchmark session: load the backends, run the plan, assemble the results document.

    results = {"meta": {...}, "configs": [...], "comparisons": [...], "goals": [...]}

(`bench.schema` lists the keys every entry has.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import sys
import time
from typing import Any

from specmesh.bench.runners import RunSpec
from specmesh.bench.suite import BenchSettings, compare, goals, plan
from specmesh.bench.workloads import load_workload


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    settings.validate()
    return asyncio.run(_run(settings))


async def _run(s: BenchSettings) -> dict[str, Any]:
    from specmesh.bench.stacks import (
        engine_backends,
        inprocess_backend,
        local_deployment,
        model_dtype,
    )

    started = time.time()
    runs = plan(s)
    specs = (s.spec, *s.sweep)
    backends: dict[str, Any] = {"inprocess": inprocess_backend(s.models, s.runtime, specs)}
    if s.engines:
        backends |= engine_backends(s.models, s.runtime, s.engines, s.spec)
    tokenizer = backends["inprocess"].tokenizer
    num_prompts = max(max(r.num_requests for r in runs), 1)
    workloads = {
        name: load_workload(name, tokenizer, num_prompts, s.prompt_len) for name in s.workloads
    }
    if s.transformers:
        from specmesh.bench.hf import TransformersBackend

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        dtype = model_dtype(backends["inprocess"])
        backends["transformers"] = TransformersBackend(s.models.target, dtype, pad)
    async with contextlib.AsyncExitStack() as stack:
        if s.grpc:
            deployment = local_deployment(s.models, s.spec, list(s.service_args))
            backends["grpc"], backends["cluster"] = await stack.enter_async_context(deployment)
        best: dict[str, dict[str, Any]] = {}
        for repeat in range(s.repeats):
            for i, run in enumerate(runs):
                res = await _run_one(backends[run.backend], run, workloads[run.workload].prompts)
                _keep_best(best, res)
                _progress(repeat, i, len(runs), res)
    configs = list(best.values())
    comparisons = compare(s, configs)
    return {
        "meta": _meta(s, workloads, started),
        "configs": configs,
        "comparisons": comparisons,
        "goals": goals(comparisons, configs),
    }


async def _run_one(backend: Any, run: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
    out = backend.run(run, prompts)
    return await out if asyncio.iscoroutine(out) else out


def _keep_best(best: dict[str, dict[str, Any]], res: dict[str, Any]) -> None:
    prev = best.get(res["name"])
    runs = [*(prev["tokens_per_s_runs"] if prev else []), res["tokens_per_s"]]
    if prev is None or res["tokens_per_s"] > prev["tokens_per_s"]:
        best[res["name"]] = res
    best[res["name"]]["tokens_per_s_runs"] = runs


def _progress(repeat: int, i: int, n: int, res: dict[str, Any]) -> None:
    print(
        f"[bench {repeat + 1}.{i + 1}/{n}] {res['name']}: {res['tokens_per_s']:.1f} tok/s, "
        f"accept {res['mean_accept_len']:.2f}",
        file=sys.stderr,
        flush=True,
    )


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _meta(s: BenchSettings, workloads: dict, started: float) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "cpu_model": cpu_model(),
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
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
        "settings": {k: v for k, v in dataclasses.asdict(s).items() if k not in ("models",)},
    }
