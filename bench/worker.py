"""One benchmark configuration in a fresh process of its own:

    python -m specmesh.bench.worker --json-config JOB.json

loads one side (the specmesh engine in process, a local gRPC cluster, or a transformers
baseline), sets its torch threads, warms up, runs the configuration and prints its result as
one JSON line on stdout (the fields of `runners.result`, plus ``pid`` and ``threads``).

Nothing else ever ran in the process, so no side inherits another's threads, caches or
allocator state (an engine's event-loop executor threads, for one, would otherwise compete with
transformers' OpenMP team for the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmesh.bench.runners import RunSpec
from specmesh.protocol.config import SpecParams

# One CPU core standing in for each device (`specmesh bench --pin`, `bench.predraft`): a side with
# one device runs on core 0; a cluster puts its target on core 0 and its draft, router and the
# measuring client on core 1.
ONE_DEVICE = {"driver": [0]}
TWO_DEVICES = {"target": [0], "draft": [1], "router": [1], "driver": [1]}


@dataclass(frozen=True)
class Job:
    run: RunSpec
    target: str
    draft: str | None  # the checkpoint of run.draft_kind (None: plain, n-gram)
    runtime: dict[str, Any]  # attention_backend, device (the dtype is the run's)
    threads: int  # torch threads of this process
    prompts: list[list[int]]
    pad_token_id: int
    # The draft service a plain cluster run starts anyway (kind, its speculation parameters):
    # the run's requests disable speculation, so it stands idle (`bench.hop`).
    idle_draft: tuple[str, SpecParams] | None = None
    # CPUs per process ("driver": this worker, or "target", "draft", "router" of a cluster; a
    # process without an entry keeps the worker's), and flags the draft service gets besides
    # (`bench.predraft`: one core stands in for each device).
    cpus: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    draft_args: list[str] = dataclasses.field(default_factory=list)
    target_args: list[str] = dataclasses.field(default_factory=list)  # `bench.hop`: run-ahead off
    router_args: list[str] = dataclasses.field(default_factory=list)  # `bench.hop`: no pipelining

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "run": self.run.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        idle = data.get("idle_draft")
        idle_draft = (idle[0], SpecParams(**idle[1])) if idle else None
        return cls(**{**data, "run": RunSpec.from_json(data["run"]), "idle_draft": idle_draft})


def run_job(job: Job) -> dict[str, Any]:
    run = job.run
    if run.backend == "transformers":
        from specmesh.bench.hf import TransformersBackend
        from specmesh.runtime.config import parse_dtype

        draft = job.draft if run.draft_kind == "standalone" else None
        device = job.runtime.get("device", "cpu")
        hf = TransformersBackend(
            job.target, parse_dtype(run.dtype), job.pad_token_id, draft, device
        )
        return hf.run(run, job.prompts)
    return asyncio.run(_run_router_side(job))


async def _run_router_side(job: Job) -> dict[str, Any]:
    from specmesh.bench.stacks import engine_runtime, inprocess_backend, local_deployment
    from specmesh.defaults import ModelChoice
    from specmesh.rpc.heap import frozen_startup_heap

    run = job.run
    models = ModelChoice(job.target, job.draft, run.draft_kind)
    runtime = {**job.runtime, "dtype": run.dtype}
    if run.backend == "cluster":
        kind, spec = _cluster_draft(job)
        models = dataclasses.replace(models, draft_kind=kind)
        spawn = _placed_spawn(job)
        async with local_deployment(models, spec, runtime, run.speculation, spawn=spawn) as cluster:
            with frozen_startup_heap("bench driver"):  # as each of its services
                return await cluster.run(run, job.prompts)
    if run.backend.startswith("engine:"):
        runtime = engine_runtime(runtime, run.backend.removeprefix("engine:"))
    elif run.backend != "inprocess":
        raise ValueError(f"the worker runs no {run.backend!r} side")
    specs = (run.spec,) if run.spec else ()
    backend = inprocess_backend(models, runtime, specs, name=run.backend)
    with frozen_startup_heap("bench in process"):  # as a cluster's services, once ready
        return await backend.run(run, job.prompts)


def _placed_spawn(job: Job) -> Any:
    """`spawn_service` starting each service on its CPUs (a child inherits the affinity its
    parent has when it starts) with the draft's and the target's extra flags."""
    from specmesh.cluster import spawn_service

    def spawn(children: list, kind: str, flags: list[str]) -> str:
        by_kind = {"draft": job.draft_args, "target": job.target_args, "router": job.router_args}
        extra = by_kind.get(kind, [])
        mine = os.sched_getaffinity(0)
        if kind in job.cpus:
            os.sched_setaffinity(0, job.cpus[kind])
        try:
            return spawn_service(children, kind, [*flags, *extra])
        finally:
            os.sched_setaffinity(0, mine)

    return spawn


def _cluster_draft(job: Job) -> tuple[str, SpecParams]:
    """The draft service a cluster run starts: the run's own, or a plain run's idle one."""
    run = job.run
    if run.spec is not None and run.draft_kind is not None:
        return run.draft_kind, run.spec
    if job.idle_draft is None:
        raise ValueError("the cluster side runs with its draft (a plain run names an idle one)")
    return job.idle_draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.worker", description=__doc__)
    parser.add_argument("--json-config", required=True, metavar="FILE", help="the Job, as JSON")
    args = parser.parse_args(argv)
    job = Job.from_json(json.loads(Path(args.json_config).read_text()))
    if "driver" in job.cpus:
        os.sched_setaffinity(0, job.cpus["driver"])
    import torch

    torch.set_num_threads(job.threads)
    out = run_job(job)
    out |= {"pid": os.getpid(), "threads": torch.get_num_threads()}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
