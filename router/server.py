"""The router service: the public `specmesh.v1.Generation` API over `RouterCore` and gRPC clients.

Generate validates and tokenizes the request, submits it to the core and streams its chunks.
The call's end is the request's end: a client that cancels or passes its deadline cancels the
handler, which closes the core's iterator, which aborts the request; its worker then releases
its state in both services, in-band. A request the core fails ends with the error's status;
tokens already streamed stay streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from specmesh import __version__
from specmesh.protocol.codec import GRPC_MAX_MESSAGE_BYTES
from specmesh.protocol.errors import InvalidRequestError, SpecmeshError
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.detokenizer import Detokenizer
from specmesh.router.grpc_clients import GrpcDraftClient, GrpcTargetClient
from specmesh.router.limits import (
    ContextLengthError,
    PromptEncoder,
    RouterLimits,
    check_prompt_tokens,
    check_request,
    check_stop_rules,
    grpc_connection_cap,
    raise_fd_limit,
)
from specmesh.router.metrics_admission import counts_rejections
from specmesh.router.request import Chunk, Request
from specmesh.router.router_config import RouterConfig
from specmesh.router.smg_worker import add_smg_worker
from specmesh.router.structured import ConstraintChecker
from specmesh.router.tokenizer import fetch_tokenizer, load_tokenizer, resolve_seed
from specmesh.rpc.heap import frozen_startup_heap
from specmesh.rpc.malformed import add_servicer
from specmesh.rpc.security import TlsFiles, api_key_interceptors, model_name
from specmesh.rpc.service_common import ServiceHost
from specmesh.rpc.wire import abort_with, logprobs_to_pb, sampling_from_pb
from specmesh.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class PreconditionError(SpecmeshError):
    grpc_code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class RouterSettings:
    targets: tuple[str, ...]  # HOST:PORT of each target replica
    drafts: tuple[str, ...] = ()  # HOST:PORT of each draft replica (none = no speculation)
    address: str = "127.0.0.1:50051"
    core: RouterConfig = field(default_factory=RouterConfig)
    tokenizer: str | None = None  # a checkpoint dir; default: the targets' (GetTokenizer)
    # The services share this host's /dev/shm: feature rows through it (`protocol.shared_rows`)
    shared_memory: bool = False
    max_new_tokens: int = 256  # default for requests that leave it 0
    max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES
    connect_timeout_s: float = 300.0  # how long to wait for every service to answer GetInfo
    # TLS on the public port (no client certificate asked) and mTLS to targets and drafts
    tls: TlsFiles | None = None
    api_key: str | None = None  # required from Generation callers; health stays open
    limits: RouterLimits = field(default_factory=RouterLimits)  # per request, before any work
    # OpenAI-compatible HTTP API (`specmesh.router.openai_api`) beside the gRPC port: HOST:PORT
    # (port 0: any free one), None = off. Same TLS certificate and API key as the gRPC port.
    http_address: str | None = None
    chat_template: str | None = None  # Jinja file; default: the tokenizer's own chat template
    # vLLM's flag: speculative figures in each OpenAI response ("none", "summary", "detailed";
    # a request's spec_decode_metrics field overrides it): `specmesh.router.openai_spec`
    per_request_spec_decode_metrics: str = "none"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, host: ServiceHost, settings: RouterSettings) -> None:
        self.host, self.settings = host, settings
        self.core: RouterCore | None = None  # set by `attach` once every service answered
        self.tokenizer = None
        self.prompts = PromptEncoder(settings.limits)  # tokenizes off the event loop
        self.constraints = ConstraintChecker()  # grammar compile checks, off the event loop

    async def attach(self, core: RouterCore, tokenizer) -> None:
        self.core, self.tokenizer = core, tokenizer
        await self.host.set_ready()

    async def GetInfo(self, request, context) -> generation_pb2.InfoResponse:
        core = await self._ready(context)
        target = core.targets[0].info_pb
        draft = core.drafts[0].info_pb if core.drafts else None
        return generation_pb2.InfoResponse(
            model_name=core.served_model,  # --served-model-name, else the target's name
            model_path=model_name(target.model_path),  # services report names, never paths
            vocab_size=target.vocab_size,
            max_context_len=target.max_context_len,
            draft_kind=draft.draft_kind if draft else "",
            num_steps=draft.num_steps if draft else 0,
            topk=draft.topk if draft else 0,
            num_draft_tokens=draft.num_draft_tokens if draft else 0,
            num_target_replicas=core.num_live_targets,
            num_draft_replicas=len(core.replicas.live_drafts()),
            version=__version__,
            supports_images=target.supports_images,
        )

    async def Generate(self, request, context):
        core = await self._ready(context)
        async with self.host.work(context):
            try:
                req = await self._make_request(core, request)
            except SpecmeshError as e:
                await abort_with(context, e)
            chunks = core.generate(req)
            try:
                async for chunk in chunks:
                    yield _response(req, chunk)
            except SpecmeshError as e:
                await abort_with(context, e)
            finally:
                await chunks.aclose()  # on cancel: aborts the request, releases its KV

    async def _ready(self, context: grpc.aio.ServicerContext) -> RouterCore:
        if self.core is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the router is still connecting to its services"
            )
        return self.core

    @counts_rejections("core")  # each refusal counted by reason (admission_rejections_total)
    async def _make_request(
        self,
        core: RouterCore,
        msg: generation_pb2.GenerateRequest,
        params: SamplingParams | None = None,
    ) -> Request:
        """Every limit first, from sizes alone (`specmesh.router.limits`); then sampling values
        and stop rules; then the tokenizer, off the event loop; then the request.

        ``params``: sampling values the message cannot carry (the OpenAI HTTP API builds them
        from its JSON, `specmesh.router.openai_api`); by default they come from ``msg.sampling``.
        """
        if bool(msg.prompt) == bool(msg.prompt_token_ids):
            raise InvalidRequestError("set exactly one of prompt and prompt_token_ids")
        rid = msg.request_id or uuid.uuid4().hex
        target = core.targets[0].info_pb
        max_prompt_tokens = target.max_context_len - 1
        check_request(msg, rid, self.settings.limits, max_prompt_tokens)
        if msg.images and not target.supports_images:
            raise InvalidRequestError(
                f"{target.model_path} is not a vision-language model", param="images"
            )
        if msg.prompt and self.tokenizer is None:
            raise PreconditionError(
                "the router has no tokenizer (its targets serve none and no --tokenizer was "
                "given); send prompt_token_ids"
            )
        if params is None:
            params = sampling_from_pb(msg.sampling, self.settings.max_new_tokens)
        check_stop_rules(params, core.info.vocab_size)
        if params.constraint is not None:
            info = core.info
            await self.constraints.check(
                params.constraint, self.tokenizer, info.vocab_size, info.eos_token_ids
            )
        if msg.prompt_token_ids:
            ids = list(msg.prompt_token_ids)
        else:
            ids = await self.prompts.encode(self.tokenizer, rid, msg.prompt)
            check_prompt_tokens(rid, len(ids), max_prompt_tokens)
        # prompt + max_new_tokens fill at most the context: the last draft trees are cut to the
        # room left (`round._fitted`), so speculation needs none reserved here
        room = target.max_context_len - len(ids)
        if not msg.sampling.max_new_tokens:  # the router's default, cut to the room left
            params = replace(params, max_new_tokens=max(1, min(self.settings.max_new_tokens, room)))
        if ids and params.max_new_tokens > room:
            raise ContextLengthError(rid, len(ids), target.max_context_len, params.max_new_tokens)
        return Request(
            rid,
            ids,
            replace(params, seed=resolve_seed(params.seed)),
            core.info.eos_token_ids,
            speculate=not msg.disable_speculation,
            learn=not msg.exclude_from_learning,
            images=list(msg.images),
            detok=Detokenizer(self.tokenizer, ids) if self.tokenizer is not None else None,
        )


def _response(req: Request, chunk: Chunk) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(
        request_id=req.rid,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason or "",
        logprobs=logprobs_to_pb(chunk.logprobs or []),
        prompt_logprobs=logprobs_to_pb([e for e in chunk.prompt_logprobs or [] if e is not None]),
    )
    if chunk.finish_reason is not None:
        now = time.monotonic()
        msg.stats.CopyFrom(
            generation_pb2.RequestStats(
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=req.num_generated,
                num_rounds=len(req.accept_lens),
                accept_lens=req.accept_lens,
                num_draft_tokens=req.num_draft_tokens,
                num_predraft_hits=req.num_predraft_hits,
                draft_wait_s=req.draft_wait_s,
                cached_tokens=req.cached_tokens,
                num_plain_rounds=sum(1 for d in req.round_drafts if d == 0),
                plain_reason=req.last_plain.describe() if req.last_plain is not None else "",
                draft_weight_versions=req.draft_weight_versions,
                mean_accept_len=req.mean_accept_len or 1.0,
                time_to_first_token_s=(req.first_token_s or now) - req.arrival_s,
                total_time_s=now - req.arrival_s,
            )
        )
    return msg


class RouterService:
    """The router process's parts: the server, the clients, the core. `start` listens at once
    (liveness), then waits until every service answered GetInfo (readiness)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.host = ServiceHost(
            SERVICE_NAME,
            settings.address,
            settings.max_message_bytes,
            interceptors=api_key_interceptors(settings.api_key),
            max_connections=grpc_connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
        )
        self.servicer = GenerationServicer(self.host, settings)
        # malformed request bytes: INVALID_ARGUMENT
        add_servicer(
            generation_pb2_grpc.add_GenerationServicer_to_server, self.servicer, self.host.server
        )
        add_smg_worker(self.servicer)  # SMG's smg.worker.v1 on the same port (docs/smg.md)
        tls = settings.tls.channel_credentials() if settings.tls else None
        # This router's namespace for request ids at the services: another router on the same
        # target and draft (a rolling update) may be given the same client ids.
        self.id_prefix = f"{secrets.token_hex(4)}/"
        self.targets = [
            GrpcTargetClient(
                a,
                f"target-{i}@{a}",
                credentials=tls,
                id_prefix=self.id_prefix,
                shared_memory=settings.shared_memory,
            )
            for i, a in enumerate(settings.targets)
        ]
        self.drafts = [
            GrpcDraftClient(a, f"draft-{i}@{a}", credentials=tls, id_prefix=self.id_prefix)
            for i, a in enumerate(settings.drafts)
        ]
        self.core: RouterCore | None = None
        self.http = None  # the OpenAI-compatible HTTP front, when settings.http_address is set
        if settings.http_address is not None:
            from specmesh.router.openai_server import HttpFront

            self.http = HttpFront(self.servicer, settings)

    @property
    def port(self) -> int:
        return self.host.port

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    async def start(self) -> None:
        tls = self.settings.tls
        await self.host.start(tls.server_credentials(require_client_auth=False) if tls else None)
        if self.http is not None:
            await self.http.start()  # answers 503 until the services answered
        timeout = self.settings.connect_timeout_s
        await asyncio.gather(*(c.connect(timeout) for c in [*self.targets, *self.drafts]))
        _check_compatible(self.targets, self.drafts)
        self.core = RouterCore(self.targets, self.drafts, self.settings.core)
        await self.core.start()
        await self.servicer.attach(self.core, await self._tokenizer())
        log.info("router ready on port %d, at most %d gRPC connections", self.port,
                 self.host.max_connections)  # fmt: skip

    async def _tokenizer(self):
        """``--tokenizer``, else the one the targets serve (`fetch_tokenizer`), else None."""
        path = self.settings.tokenizer
        if path is not None:
            if not Path(path).is_dir():
                raise ValueError(f"--tokenizer {path}: no such directory")
            return await asyncio.to_thread(load_tokenizer, path)
        return await fetch_tokenizer(self.targets)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Drain (NOT_SERVING, refuse new requests, finish running ones), then close."""
        await self.host.shutdown(grace_s)
        await self.close()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self.core is not None:
            await self.core.stop()
        for client in [*self.targets, *self.drafts]:
            with contextlib.suppress(Exception):
                await client.close()


def _check_compatible(targets: list[GrpcTargetClient], drafts: list[GrpcDraftClient]) -> None:
    vocab = {t.info.vocab_size for t in targets} | {d.info_pb.vocab_size for d in drafts}
    if len(vocab) > 1:
        raise ValueError(f"targets and drafts disagree on the vocabulary size: {sorted(vocab)}")
    # A draft refuses features of another dtype than its own (it never casts): every step of
    # it would fail. Each service picks its own default dtype (fp32 on a CPU), so say it here.
    readers = [d for d in drafts if d.info.needs.feature is not Feature.NONE]
    dtypes = {f"{c.name}: {c.info_pb.dtype}" for c in [*targets, *readers]}
    if len({c.info_pb.dtype for c in [*targets, *readers]}) > 1:
        raise ValueError(
            f"targets and drafts run different dtypes ({'; '.join(sorted(dtypes))}): the draft "
            "reads the target's features as they are, so give both the same --dtype"
        )


async def serve(settings: RouterSettings, grace_s: float = 30.0) -> None:
    """Process entry: start (a SIGTERM while connecting stops it too), serve until SIGTERM."""
    raise_fd_limit()  # before any socket: the HTTP port's connection cap derives from it
    service = RouterService(settings)
    start = asyncio.ensure_future(service.start())
    signalled = asyncio.ensure_future(service.host.run_until_signal(grace_s))
    try:
        await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            start.result()  # a start-up failure ends the process
            with frozen_startup_heap(service.host.service_name):
                await signalled
    finally:
        start.cancel()
        if not signalled.done():
            signalled.cancel()
            await service.host.shutdown(0.0)
        await service.close()
