"""Build the benchmark's backends: the in-process stack, and a local gRPC deployment (target,
draft and router as child processes, the way ``specmesh up`` starts them) with both the
router-in-this-process clients and the cluster's public address.

The target weights are loaded once per process; a draft is (re)loaded when the speculation
parameters change (the gRPC draft service serves the one set it was started with).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from specmesh.bench.probes import count_step_bytes
from specmesh.bench.runners import ClusterBackend, RouterBackend
from specmesh.defaults import ModelChoice
from specmesh.draft_service.drafter import SpecParams
from specmesh.draft_service.runtime import DraftConfig, load_draft
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.runtime.tokenizer import load_tokenizer
from specmesh.target_service.runtime import TargetConfig, TargetRuntime

READY_TIMEOUT_S = 600.0


def inprocess_backend(
    models: ModelChoice,
    runtime: dict[str, Any],
    specs: tuple[SpecParams, ...] = (),
    *,
    name: str = "inprocess",
    model: Any = None,
) -> RouterBackend:
    """The in-process stack; ``specs`` name the tree sizes a GPU captures verify graphs for, and
    ``model`` shares already loaded target weights."""
    sizes = {"cuda_graph_tree_sizes": tuple(sorted({s.num_draft_tokens for s in specs}))}
    tcfg = TargetConfig(models.target, **runtime, **(sizes if specs else {}))
    target = TargetRuntime(tcfg, model=model)
    loaded: dict[SpecParams, list[InProcessDraft]] = {}

    def drafts_by_spec(spec: SpecParams) -> list[InProcessDraft]:
        if models.draft_kind is None:
            raise ValueError("speculative configurations need a draft (--draft-kind)")
        if spec not in loaded:
            loaded.clear()  # keep one draft (and its KV cache) at a time
            cfg = DraftConfig(models.draft_kind, models.draft, models.target, spec, **runtime)
            loaded[spec] = [InProcessDraft(load_draft(cfg, target_model=target.model))]
        return loaded[spec]

    return RouterBackend(
        name,
        [InProcessTarget(target)],
        drafts_by_spec,
        load_tokenizer(models.target),
        target.model_config.eos_token_ids,
    )


def engine_backends(
    models: ModelChoice, runtime: dict[str, Any], variants: tuple[str, ...], spec: SpecParams
) -> dict[str, RouterBackend]:
    """One in-process stack per engine variant (``<attention backend>[+graphs]``), all over one
    copy of the target weights; each has its own KV cache, backend and graphs."""
    out: dict[str, RouterBackend] = {}
    model = None
    for v in variants:
        backend, _, graphs = v.partition("+")
        rt = {**runtime, "attention_backend": backend, "cuda_graph": graphs == "graphs"}
        stack = inprocess_backend(models, rt, (spec,), name=f"engine:{v}", model=model)
        model = stack.targets[0].runtime.model
        out[stack.backend] = stack
    return out


def model_dtype(backend: RouterBackend) -> Any:
    return next(backend.targets[0].runtime.model.parameters()).dtype


@contextlib.asynccontextmanager
async def local_deployment(
    models: ModelChoice, spec: SpecParams, service_args: list[str]
) -> AsyncIterator[tuple[RouterBackend, ClusterBackend]]:
    """Start target, draft and router processes on loopback ports; yield the gRPC router
    backend (this process routes) and the cluster backend (the router process routes)."""
    from specmesh.cluster import model_threads, spawn_service, stop_all, wait_ready
    from specmesh.router.grpc_clients import GrpcDraftClient, GrpcTargetClient

    if models.draft_kind is None:
        raise ValueError("the gRPC benchmark needs a draft (--draft-kind)")
    children: list = []
    clients: list = []
    threads = ["--threads", str(model_threads(2))]
    try:
        tree_sizes = ["--cuda-graph-tree-sizes", str(spec.num_draft_tokens)]
        target_addr = spawn_service(
            children, "target", ["--model", models.target, *tree_sizes, *threads, *service_args]
        )
        draft_flags = [
            "--kind", models.draft_kind, "--target-model", models.target,
            *(["--model", models.draft] if models.draft else []),
            "--num-steps", str(spec.num_steps), "--topk", str(spec.topk),
            "--num-draft-tokens", str(spec.num_draft_tokens), *threads, *service_args,
        ]  # fmt: skip
        draft_addr = spawn_service(children, "draft", draft_flags)
        router_flags = ["--target", target_addr, "--draft", draft_addr, "--threads", "1"]
        router_addr = spawn_service(children, "router", router_flags)
        wait_ready(children, READY_TIMEOUT_S)
        target, draft = GrpcTargetClient(target_addr), GrpcDraftClient(draft_addr)
        clients = [target, draft]
        for client in clients:
            await client.connect()
            count_step_bytes(client)

        def drafts_by_spec(wanted: SpecParams) -> list:
            if wanted != spec:
                raise ValueError(f"the draft service runs {spec}, not {wanted}")
            return [draft]

        tokenizer = load_tokenizer(models.target)
        routed = RouterBackend(
            "grpc", [target], drafts_by_spec, tokenizer, target.info.eos_token_ids
        )
        yield routed, ClusterBackend(router_addr, spec)
    finally:
        for client in clients:
            await client.close()
        stop_all(children)
