"""The router as an SMG worker: SMG's engine-neutral smg.worker.v1 services on the router's gRPC
port, a thin façade over the core that serves `specmesh.v1.Generation` (docs/smg.md).

    WorkerInference.Generate  translated (`smg_wire.generation_request`), then built and checked
                              by `GenerationServicer` as any Generation request and run by
                              `RouterCore.generate`; its chunks become smg chunks and one
                              GenerateComplete (`smg_wire.Completion`)
    WorkerInference.Abort     ends a running Generate in-band: its stream gets an "abort"
                              GenerateComplete and its worker releases it in target and draft
    WorkerControl             identity, capabilities, health (STARTING until every service
                              answered, then SERVING / DEGRADED / NOT_SERVING from the replicas'
                              breakers, DRAINING once shutdown began) and topology

Both services live on the router's `ServiceHost`: its TLS, API key, message limits and drain
(a Generate counts as in-flight work: a draining router refuses new ones with UNAVAILABLE and
waits for the running ones). Closing a Generate call (the gateway cancels it, its deadline
passes) aborts the request, as on the Generation service.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import uuid
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from specmesh import __version__
from specmesh.protocol.errors import DuplicateRequestError, SpecmeshError
from specmesh.router.request import Request
from specmesh.router.smg_wire import Completion, Liveness, generation_request, matched_stop
from specmesh.rpc.malformed import add_servicer
from specmesh.rpc.security import model_name
from specmesh.rpc.wire import abort_with
from specmesh.smg import worker_control_pb2 as control_pb2
from specmesh.smg import worker_control_pb2_grpc as control_grpc
from specmesh.smg import worker_inference_pb2 as smg_pb2
from specmesh.smg import worker_inference_pb2_grpc as smg_grpc

if TYPE_CHECKING:  # router/server.py registers these services
    from specmesh.router.core import RouterCore
    from specmesh.router.replica import Replica
    from specmesh.router.server import GenerationServicer

log = logging.getLogger(__name__)

ENGINE_TYPE = "specmesh"
API_VERSION = (1, 0)  # smg.worker.v1, as SMG's protos define it
FEATURES = ("generate", "abort", "token_id_streaming", "logprobs", "seeded_sampling")
States = control_pb2.WorkerHealthState


def add_smg_worker(front: GenerationServicer) -> None:
    """Serve WorkerInference and WorkerControl on ``front``'s server, beside Generation."""
    server = front.host.server
    inference = WorkerInferenceServicer(front)
    add_servicer(smg_grpc.add_WorkerInferenceServicer_to_server, inference, server)
    control = WorkerControlServicer(front)
    add_servicer(control_grpc.add_WorkerControlServicer_to_server, control, server)


async def _ready(front: GenerationServicer, context: grpc.aio.ServicerContext) -> RouterCore:
    if front.core is None:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, "the router is still connecting to its services"
        )
    return front.core


class WorkerInferenceServicer(smg_grpc.WorkerInferenceServicer):
    def __init__(self, front: GenerationServicer) -> None:
        self.front = front
        self.running: dict[str, Request] = {}  # by request id: the requests Abort may end

    async def Generate(self, request: smg_pb2.GenerateRequest, context):
        core = await _ready(self.front, context)
        async with self.front.host.work(context):
            try:
                msg = generation_request(request, core.info.eos_token_ids)
                req = await self.front._make_request(core, msg)  # the Generation path's checks
                if req.rid in self.running:
                    raise DuplicateRequestError(f"request id {req.rid!r} is already in use")
            except (SpecmeshError, ValueError) as e:  # a ValueError: INVALID_ARGUMENT
                await abort_with(context, e)
            completion = Completion(req.rid, len(req.prompt_ids), request.stream)
            chunks = core.generate(req)
            # Nothing awaits between here and the core's first step of `chunks`, which opens
            # the request's stream: an Abort always finds it (`RouterCore.push`).
            self.running[req.rid] = req
            try:
                async for chunk in chunks:
                    stop = await self._matched_stop(req) if chunk.finish_reason == "stop" else None
                    for answer in completion.answer(chunk, req.cached_tokens, stop):
                        yield answer
            except SpecmeshError as e:
                await abort_with(context, e)
            finally:
                if self.running.get(req.rid) is req:
                    del self.running[req.rid]
                await chunks.aclose()  # on cancel: aborts the request, releases its KV

    async def _matched_stop(self, req: Request) -> dict:
        """Which stop rule ended ``req``; the output is decoded (off the event loop) only when
        several stop strings could have."""
        text, tokenizer = None, self.front.tokenizer
        if len(req.params.stop) > 1 and tokenizer is not None:
            text = await asyncio.to_thread(
                tokenizer.decode, req.output_ids, skip_special_tokens=True
            )
        return matched_stop(req.output_ids, req.params, req.eos_token_ids, text)

    async def Abort(self, request: smg_pb2.AbortRequest, context) -> smg_pb2.AbortResponse:
        """The request finishes "abort" at once; its running round's tokens are not sent.
        Idempotent: an id that runs nothing (finished, cancelled, never seen) is a success too,
        as the gateway aborts every stream it drops, often after the call already ended."""
        rid = request.request_id
        req, core = self.running.get(rid), self.front.core
        if req is None or req.finished or core is None:
            return smg_pb2.AbortResponse(success=True, message=f"{rid!r} is not running")
        core.push(req, req.abort())  # its Generate sends the GenerateComplete and returns
        log.info("smg abort of %s: %s", rid, request.reason or "no reason given")
        return smg_pb2.AbortResponse(success=True, message="aborted")


class WorkerControlServicer(control_grpc.WorkerControlServicer):
    def __init__(self, front: GenerationServicer) -> None:
        self.front = front
        self.instance_id = uuid.uuid4().hex  # this process
        self.hostname = socket.gethostname()
        self.started_at = _now()

    @property
    def worker_id(self) -> str:
        """Stable across restarts: the host and the gRPC port the router listens on."""
        return f"{self.hostname}:{self.front.host.port}"

    async def GetIdentity(self, request, context) -> control_pb2.GetIdentityResponse:
        identity = control_pb2.WorkerIdentity(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            hostname=self.hostname,
            version=__version__,
            started_at=self.started_at,
            labels={"engine": ENGINE_TYPE, "role": "router"},
        )
        return control_pb2.GetIdentityResponse(identity=identity)

    async def GetCapabilities(self, request, context) -> control_pb2.GetCapabilitiesResponse:
        core = await _ready(self.front, context)
        spec = ("speculative_decoding",) if core.drafts else ()
        engine = control_pb2.EngineCapability(
            engine_type=ENGINE_TYPE,
            engine_version=__version__,
            model_ids=[model_name(core.targets[0].info_pb.model_path)],
            features=[*FEATURES, *spec],
        )
        capabilities = control_pb2.WorkerCapabilities(
            api_major=API_VERSION[0],
            api_minor=API_VERSION[1],
            features=[*FEATURES, *spec],
            engines=[engine],
            max_concurrent_requests=_capacity(core),
            attributes=_attributes(core),
        )
        return control_pb2.GetCapabilitiesResponse(capabilities=capabilities)

    async def GetHealth(self, request, context) -> control_pb2.GetHealthResponse:
        core, now = self.front.core, _now()
        replicas = core.replicas if core is not None else None
        state, message = Liveness(
            ready=core is not None,
            draining=self.front.host.draining,
            live_targets=len(replicas.live_targets()) if replicas else 0,
            num_targets=len(self.front.settings.targets),
            live_drafts=len(replicas.live_drafts()) if replicas else 0,
            num_drafts=len(self.front.settings.drafts),
        ).state()
        components = []
        if request.include_components and replicas is not None:
            components = [_component(r, now) for r in replicas.all]
        return control_pb2.GetHealthResponse(
            state=state, message=message, checked_at=now, components=components
        )

    async def GetTopology(self, request, context) -> control_pb2.GetTopologyResponse:
        """Every target and draft replica the router dials; their models once connected."""
        settings, core = self.front.settings, self.front.core
        targets = core.targets if core is not None else [None] * len(settings.targets)
        drafts = core.drafts if core is not None else [None] * len(settings.drafts)
        engines = [
            _endpoint(kind, i, address, client)
            for kind, addresses, clients in (
                ("target", settings.targets, targets),
                ("draft", settings.drafts, drafts),
            )
            for i, (address, client) in enumerate(zip(addresses, clients, strict=True))
        ]
        layout = "\n".join(f"{e.engine_id} {e.endpoint}" for e in engines).encode()
        topology = control_pb2.WorkerTopology(
            worker_id=self.worker_id,
            topology_version=int.from_bytes(hashlib.sha256(layout).digest()[:8], "big"),
            engines=engines,
            observed_at=_now(),
        )
        return control_pb2.GetTopologyResponse(topology=topology)


def _component(replica: Replica, now: Timestamp) -> control_pb2.ComponentHealth:
    live = replica.live
    return control_pb2.ComponentHealth(
        component_id=replica.name,
        state=States.WORKER_HEALTH_STATE_SERVING
        if live
        else States.WORKER_HEALTH_STATE_NOT_SERVING,
        message="" if live else "down: its circuit breaker is open",
        checked_at=now,
    )


def _endpoint(kind: str, index: int, address: str, client) -> control_pb2.EngineEndpoint:
    """One replica; ``client`` (None until the router connected) adds its model and shape."""
    endpoint = control_pb2.EngineEndpoint(
        engine_id=f"{kind}-{index}",
        engine_type=f"{ENGINE_TYPE}-{kind}",
        endpoint=f"grpc://{address}",
        replica_group=kind,
    )
    if client is not None:
        info = client.info_pb
        name = model_name(info.model_path)
        endpoint.model_ids.extend([name] if name else [])  # an n-gram draft has no model
        shape = ("draft_kind", "num_steps", "topk", "num_draft_tokens") if kind == "draft" else ()
        for key in ("dtype", "device", "attention_backend", *shape):
            endpoint.attributes[key] = str(getattr(info, key))
    return endpoint


def _capacity(core: RouterCore) -> int:
    """Requests the router runs at once (more wait in its queue): each micro-batch's
    max_batch_size, at most what the targets hold together (0 each: no limit)."""
    running = core.num_micro_batches * core.cfg.max_batch_size
    limits = [t.info.max_requests for t in core.targets]
    return min(running, sum(limits)) if all(limits) else running


def _attributes(core: RouterCore) -> dict[str, str]:
    target = core.targets[0].info_pb
    draft = core.drafts[0].info_pb if core.drafts else None
    shape = {
        key: str(getattr(draft, key)) if draft is not None else ""
        for key in ("draft_kind", "num_steps", "topk", "num_draft_tokens")
    }
    return {
        **shape,
        "max_context_len": str(target.max_context_len),
        "vocab_size": str(target.vocab_size),
        "num_target_replicas": str(len(core.targets)),
        "num_draft_replicas": str(len(core.drafts)),
        "max_waiting_requests": str(core.cfg.max_waiting),
    }


def _now() -> Timestamp:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return stamp
