"""Run one benchmark configuration against a backend and return its result fields.

Backends (each configuration runs in its own process, see `bench.worker`):

- ``inprocess``: `RouterCore` over `InProcessTarget` / `InProcessDraft` (what `Engine` runs);
  ``engine:<attention backend>[+graphs]`` is the same on another attention backend;
- ``cluster``: the whole deployment: target, draft and router processes; requests go to the
  router through the public `Generation` API (what a user sees; no time split);
- ``transformers``: `bench.hf`; ``llamacpp``: `bench.llamacpp`.

Every request is streamed and timed chunk by chunk; ``batch_size`` is the number of requests in
flight at once (a client-side concurrency limit; the router batches what it has).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specmesh.bench.metrics import RequestTrace, summarize
from specmesh.bench.probes import CallLog, TimedDraft, TimedTarget, time_split
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.detokenizer import Detokenizer
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig

BACKENDS = ("inprocess", "cluster", "transformers", "llamacpp")
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class RunSpec:
    backend: str
    workload: str
    batch_size: int  # requests in flight at once
    temperature: float
    spec: SpecParams | None  # None = plain decoding (one token per target forward)
    max_new_tokens: int
    num_requests: int
    dtype: str = "bf16"  # weights and activations, both sides of a comparison alike
    draft_kind: str | None = None  # eagle3, ngram, standalone...; None exactly when plain
    # The router's --speculation mode of a drafting side: "always" verifies every full tree,
    # "adaptive" lets the policy pick plain rounds and tree sizes (`router.policy`).
    speculation: str = "always"

    def __post_init__(self) -> None:
        if (self.spec is None) != (self.draft_kind is None):
            raise ValueError(f"{self.backend}: a draft kind goes with speculation parameters")

    @property
    def mode(self) -> str:
        s, kind = self.spec, self.draft_kind
        if s is None:
            return "plain"
        if self.backend == "transformers":  # what transformers calls its drafting
            labels = {"ngram": f"lookup-{s.num_draft_tokens - 1}", "standalone": f"assisted-{s.num_steps}"}  # fmt: skip
            return labels.get(kind or "", f"{kind}-unsupported")
        suffix = "-adaptive" if self.speculation == "adaptive" else ""
        return f"{kind}-{s.num_steps}-{s.topk}-{s.num_draft_tokens}{suffix}"

    @property
    def name(self) -> str:
        where = f"{self.backend}/{self.dtype}/{self.workload}"
        return f"{where}/b{self.batch_size}/t{self.temperature:g}/{self.mode}"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "spec": self.spec and dataclasses.asdict(self.spec)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        spec = data.get("spec")
        return cls(**{**data, "spec": SpecParams(**spec) if spec else None})

    def sampling(self, index: int) -> SamplingParams:
        """Every request generates exactly max_new_tokens (EOS ignored), seeded by its index."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=index,
            ignore_eos=True,
        )

    def fields(self) -> dict[str, Any]:
        s = self.spec
        return {
            "name": self.name,
            "backend": self.backend,
            "workload": self.workload,
            "batch_size": self.batch_size,
            "temperature": self.temperature,
            "speculative": s is not None,
            "dtype": self.dtype,
            "draft_kind": self.draft_kind,
            "speculation": self.speculation if s else "never",
            "num_steps": s.num_steps if s else 0,
            "topk": s.topk if s else 0,
            "num_draft_tokens": s.num_draft_tokens if s else 0,
            "max_new_tokens": self.max_new_tokens,
        }


RunOne = Callable[[int, RequestTrace], Awaitable[None]]


async def drive(run_one: RunOne, num_requests: int, concurrency: int) -> tuple[list, float]:
    """Run requests 0..num_requests-1 with at most ``concurrency`` in flight; traces + wall."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> RequestTrace:
        async with gate:
            trace = RequestTrace(time.perf_counter())
            await run_one(index, trace)
            return trace

    start = time.perf_counter()
    traces = await asyncio.gather(*(one(i) for i in range(num_requests)))
    return list(traces), time.perf_counter() - start


def result(
    spec: RunSpec, traces: list, wall_s: float, split: dict, num_bytes: int, bytes_scope: str
) -> dict[str, Any]:
    stats = summarize(traces, wall_s, spec.spec.num_steps if spec.spec else 0)
    tokens = stats["generated_tokens"]
    return {
        **spec.fields(),
        **stats,
        "time_split": split,
        "wire_bytes": num_bytes,
        "bytes_per_token": num_bytes / tokens if tokens else 0.0,
        "bytes_scope": bytes_scope,  # which traffic wire_bytes counts
    }


@dataclass
class RouterBackend:
    """Targets and drafts (in-process or gRPC clients) that a `RouterCore` is built over."""

    backend: str  # "inprocess" or "engine:<attention backend>[+graphs]"
    targets: list[Any]
    drafts_by_spec: Callable[[SpecParams], list[Any]]
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    router_config: RouterConfig = field(default_factory=RouterConfig)

    async def run(self, spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
        """The engine side: in-process, so no bytes cross a wire."""
        log = CallLog()
        targets = [TimedTarget(t, log) for t in self.targets]
        drafts = [TimedDraft(d, log) for d in self.drafts_by_spec(spec.spec)] if spec.spec else []
        core = RouterCore(
            targets, drafts, replace(self.router_config, speculation=spec.speculation)
        )
        plans = count_plans(core)
        await core.start()
        try:
            await self._stream(
                core, prompts[0], replace_tokens(spec, WARMUP_TOKENS), RequestTrace(0)
            )
            log.intervals.clear()
            plans.clear()

            async def run_one(i: int, trace: RequestTrace) -> None:
                await self._stream(core, prompts[i % len(prompts)], spec.sampling(i), trace)

            traces, wall_s = await drive(run_one, spec.num_requests, spec.batch_size)
        finally:
            await core.stop()
        out = result(spec, traces, wall_s, time_split(log, wall_s), 0, "none")
        return out | {"planned_tree_sizes": dict(sorted(plans.items()))}

    async def _stream(
        self, core: RouterCore, ids: list[int], params: SamplingParams, trace: RequestTrace
    ) -> None:
        req = Request(
            uuid.uuid4().hex,
            list(ids),
            params,
            self.eos_token_ids,
            speculate=bool(core.drafts),
            detok=Detokenizer(self.tokenizer, ids),
        )
        async for chunk in core.generate(req):
            trace.add_chunk(time.perf_counter(), len(chunk.token_ids))
        trace.accept_lens = list(req.accept_lens)
        trace.predraft_hits, trace.draft_wait_s = req.num_predraft_hits, req.draft_wait_s


def count_plans(core: RouterCore) -> Counter:
    """Tree size -> rounds the router's policy planned with it (1 = plain decoding), counted
    from the next plan on (so warm-up rounds can be left out by clearing it)."""
    plans: Counter = Counter()
    plan = core.policy.plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        chosen = plan(*args, **kwargs)
        plans[chosen.tree_size] += 1
        return chosen

    core.policy.plan = counted
    return plans


def replace_tokens(spec: RunSpec, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=spec.temperature, seed=0, ignore_eos=True
    )


@dataclass
class ClusterBackend:
    """The public API of a router process (`specmesh.v1.Generation`), over one aio channel."""

    address: str
    spec: SpecParams  # what the cluster's draft service was started with
    wire_bytes: int = 0  # serialized Generate requests + responses so far

    async def run(self, spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
        import grpc

        from specmesh.rpc.grpc_options import channel_options
        from specmesh.v1 import generation_pb2_grpc

        if spec.spec is not None and spec.spec != self.spec:
            raise ValueError(f"the cluster's draft runs {self.spec}, not {spec.spec}")
        async with grpc.aio.insecure_channel(self.address, options=channel_options()) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await self._stream(
                stub, spec, prompts[0], replace_tokens(spec, WARMUP_TOKENS), RequestTrace(0)
            )

            async def run_one(i: int, trace: RequestTrace) -> None:
                await self._stream(stub, spec, prompts[i % len(prompts)], spec.sampling(i), trace)

            bytes_before = self.wire_bytes
            traces, wall_s = await drive(run_one, spec.num_requests, spec.batch_size)
        num_bytes = self.wire_bytes - bytes_before
        split = {
            "wall_s": wall_s, "target_s": None, "draft_s": None, "router_s": None, "network_s": None,
            "note": "cluster: the router is a separate process; only end-to-end times are seen",
        }  # fmt: skip
        return result(spec, traces, wall_s, split, num_bytes, "client<->router Generate")

    async def _stream(
        self, stub: Any, spec: RunSpec, ids: list[int], params: SamplingParams, trace: RequestTrace
    ) -> None:
        from specmesh.rpc.wire import sampling_to_pb
        from specmesh.v1 import generation_pb2

        request = generation_pb2.GenerateRequest(
            prompt_token_ids=ids,
            sampling=sampling_to_pb(params),
            disable_speculation=spec.spec is None,
        )
        self.wire_bytes += request.ByteSize()
        async for response in stub.Generate(request, timeout=600.0):
            self.wire_bytes += response.ByteSize()
            trace.add_chunk(time.perf_counter(), len(response.token_ids))
            if response.finish_reason:
                trace.accept_lens = list(response.stats.accept_lens)
                trace.predraft_hits = response.stats.num_predraft_hits
                trace.draft_wait_s = response.stats.draft_wait_s
