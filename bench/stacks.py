"""Build one benchmark side inside a worker process (`bench.worker`): the in-process stack, or
a local gRPC deployment (target, draft and router as child processes, the way ``specmesh up``
starts them) reached through the router's public address.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from specmesh.bench.runners import ClusterBackend, RouterBackend
from specmesh.defaults import ModelChoice
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.tokenizer import load_tokenizer
from specmesh.target_service.runtime import TargetRuntime

READY_TIMEOUT_S = 600.0
# (children, kind, flags) -> address: starts one service and appends its `Child` to children
Spawn = Callable[[list, str, list[str]], str]
TARGET_ONLY = ("tensor_parallel_size",)  # runtime settings the draft does not take


def draft_runtime(runtime: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in runtime.items() if k not in TARGET_ONLY}


def inprocess_backend(
    models: ModelChoice,
    runtime: dict[str, Any],
    specs: tuple[SpecParams, ...] = (),
    *,
    name: str = "inprocess",
) -> RouterBackend:
    """The in-process stack; ``specs`` name the tree sizes a GPU captures verify graphs for."""
    sizes = {"cuda_graph_tree_sizes": tuple(sorted({s.num_draft_tokens for s in specs}))}
    tcfg = TargetConfig(models.target, **runtime, **(sizes if specs else {}))
    target = TargetRuntime(tcfg)
    loaded: dict[SpecParams, list[InProcessDraft]] = {}

    def drafts_by_spec(spec: SpecParams) -> list[InProcessDraft]:
        if models.draft_kind is None:
            raise ValueError("speculative configurations need a draft (--draft-kind)")
        if spec not in loaded:
            loaded.clear()  # keep one draft (and its KV cache) at a time
            cfg = DraftConfig(
                models.draft_kind, models.draft, models.target, spec, **draft_runtime(runtime)
            )
            loaded[spec] = [InProcessDraft(load_draft(cfg, target_model=target.model))]
        return loaded[spec]

    return RouterBackend(
        name,
        [InProcessTarget(target)],
        drafts_by_spec,
        load_tokenizer(models.target),
        target.model_config.eos_token_ids,
    )


def engine_runtime(runtime: dict[str, Any], variant: str) -> dict[str, Any]:
    """The runtime of engine variant ``<attention backend>[+graphs]``."""
    backend, _, graphs = variant.partition("+")
    return {**runtime, "attention_backend": backend, "cuda_graph": graphs == "graphs"}


@contextlib.asynccontextmanager
async def local_deployment(
    models: ModelChoice,
    spec: SpecParams,
    runtime: dict[str, Any],
    speculation: str = "always",
    router_args: Sequence[str] = (),
    spawn: Spawn | None = None,
) -> AsyncIterator[ClusterBackend]:
    """Start target, draft and router processes on loopback ports; yield the router's public
    address as a backend. Each model service gets half the cores, the router one thread and
    ``router_args`` besides. ``spawn`` starts each (default `specmesh.cluster.spawn_service`)."""
    from specmesh.cluster import model_threads, spawn_service, stop_all, wait_ready

    spawn = spawn or spawn_service

    if models.draft_kind is None:
        raise ValueError("the gRPC benchmark needs a draft (--draft-kind)")
    children: list = []
    threads = ["--threads", str(model_threads(2))]
    flags = lambda settings: [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if v is not None]  # fmt: skip
    target_args, service_args = flags(runtime), flags(draft_runtime(runtime))
    try:
        tree_sizes = ["--cuda-graph-tree-sizes", str(spec.num_draft_tokens)]
        target_addr = spawn(
            children, "target", ["--model", models.target, *tree_sizes, *threads, *target_args]
        )
        draft_flags = [
            "--kind", models.draft_kind, "--target-model", models.target,
            *(["--model", models.draft] if models.draft else []),
            "--num-steps", str(spec.num_steps), "--topk", str(spec.topk),
            "--num-draft-tokens", str(spec.num_draft_tokens), *threads, *service_args,
        ]  # fmt: skip
        draft_addr = spawn(children, "draft", draft_flags)
        router_flags = ["--target", target_addr, "--draft", draft_addr, "--threads", "1",
                        "--speculation", speculation, *router_args]  # fmt: skip
        router_addr = spawn(children, "router", router_flags)
        wait_ready(children, READY_TIMEOUT_S)
        yield ClusterBackend(router_addr, spec)
    finally:
        stop_all(children)
