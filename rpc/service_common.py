"""Plumbing shared by the three gRPC services (target, draft, router) and their clients.

- `ServiceHost`: a ``grpc.aio`` server with explicit message limits, ``grpc.health.v1``
  (``""`` = the process is up, the service's full name = ready to serve) and reflection; on
  SIGTERM / SIGINT it turns NOT_SERVING, refuses new work, drains in-flight work for a grace
  period, then stops (DESIGN.md §3).
- `ModelServicer`: the Step / GetInfo loop of the target and draft services, with request
  ownership by stream (`specmesh.rpc.ownership`).
- Channel options and `check_health` for clients. TLS credentials and the API key live in
  `specmesh.rpc.security`; statuses, framing and sampling conversion in `specmesh.rpc.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from specmesh.protocol.codec import GRPC_MAX_MESSAGE_BYTES
from specmesh.protocol.errors import SpecmeshError
from specmesh.rpc.grpc_options import connection_cap, server_options
from specmesh.rpc.heap import frozen_startup_heap
from specmesh.rpc.held_batches import Hold, StepAnswers, batch_rids
from specmesh.rpc.inline_steps import InlineSteps, for_device
from specmesh.rpc.malformed import add_servicer
from specmesh.rpc.metrics import ServiceMetrics
from specmesh.rpc.ownership import Ownership, StreamOwner
from specmesh.rpc.wire import abort_with, frame, status_pb, step_batches
from specmesh.v1 import common_pb2

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- the server host ---------------------------------------------------------------------------
class ServiceHost:
    """A grpc.aio server with health, reflection and a drain-then-stop shutdown.

    Servicers wrap every unit of work in ``async with host.work(context)``: it refuses new work
    with UNAVAILABLE once draining, and counts what is in flight so shutdown can wait for it.
    """

    def __init__(
        self,
        service_name: str,
        address: str,
        max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_connections: int | None = None,
    ) -> None:
        """``max_connections``: connections the port holds at once (default `connection_cap`);
        grpc closes one more as it is accepted, so its client sees UNAVAILABLE and retries."""
        self.service_name = service_name
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections or connection_cap()
        self.server = grpc.aio.server(
            options=server_options(max_message_bytes, self.max_connections),
            interceptors=list(interceptors),
        )
        self.health = health.aio.HealthServicer()
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        names = (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
        add_servicer(
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
            reflection.aio.ReflectionServicer(names),
            self.server,
        )
        self.port = 0  # bound by `start`
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self, credentials: grpc.ServerCredentials | None = None) -> None:
        """Listen (TLS with ``credentials``, else plaintext) and serve."""
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(self.address)
            else:
                self.port = self.server.add_secure_port(self.address, credentials)
        except RuntimeError:  # grpc's "Failed to bind", whatever the cause
            self.port = 0
        if not self.port:
            raise ValueError(
                f"cannot listen on {self.address}: the port is in use or the address is not "
                "one of this host's"
            )
        await self.server.start()
        await self.health.set(self.service_name, NOT_SERVING)  # "" is SERVING from the start

    async def set_ready(self) -> None:
        await self.health.set(self.service_name, SERVING)

    def work(self, context: grpc.aio.ServicerContext) -> _Work:
        """``async with host.work(context)``: one unit of work, refused once draining."""
        return _Work(self, context)

    async def shutdown(self, grace_s: float) -> None:
        """NOT_SERVING first, then refuse new work, wait for in-flight work, then stop."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        await self.server.stop(grace=min(1.0, grace_s))

    async def run_until_signal(self, grace_s: float) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s: signal received, draining for up to %.0f s", self.service_name, grace_s)
        await self.shutdown(grace_s)


class _Work:
    """A unit of work in flight on a `ServiceHost` (a class, not a generator: it wraps every
    step)."""

    __slots__ = ("context", "host")

    def __init__(self, host: ServiceHost, context: grpc.aio.ServicerContext) -> None:
        self.host, self.context = host, context

    async def __aenter__(self) -> None:
        host = self.host
        if host.draining:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{host.service_name} is shutting down"
            )
        host._inflight += 1
        host._idle.clear()

    async def __aexit__(self, *exc: object) -> None:
        host = self.host
        host._inflight -= 1
        if not host._inflight:
            host._idle.set()


class StreamRefusedError(SpecmeshError):
    """The stream's handshake cannot be served: the stream ends with this status."""

    grpc_code = "FAILED_PRECONDITION"


class HandshakeInvalidError(StreamRefusedError):
    """The handshake asks for what this service can never serve (aux layers outside the
    model): the stream ends with INVALID_ARGUMENT; the service serves other streams on."""

    grpc_code = "INVALID_ARGUMENT"


class ModelServicer:
    """What the target and draft servicers share: the ready gate, request ownership and the
    Step loop (DESIGN.md §3).

    Subclasses put their generated ``*Servicer`` base after this one and implement the hooks
    `info` and `run_batch` (a batch's chunks -> response messages). Every piece of runtime work
    (warm-up, each batch, each release, each stream's cleanup) runs on one worker thread, in the
    order it was submitted, or, when it is short and the worker idle, inline (`InlineSteps`);
    the event loop keeps reading streams and answering health checks. A submitted job runs even
    if its stream is cancelled meanwhile, so the cleanup a stream's end submits always runs
    after the work that stream sent before.
    """

    response_type: type  # TargetStepResponse / DraftStepResponse
    result_type: type  # TargetResult / DraftResult

    def __init__(self, host: ServiceHost, inline_step_ms: float | None = None) -> None:
        self.host, self.inline_step_ms = host, inline_step_ms  # None: `inline_steps.for_device`
        self.runtime = None  # set by `attach` once weights are loaded and warmed up
        self.owners = Ownership()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=host.service_name)
        self.inline = InlineSteps()
        self.metrics = ServiceMetrics(self)  # its own registry; served with --metrics-port

    async def attach(self, runtime, warm_up=None) -> None:
        if warm_up is not None:
            await self._submit(warm_up, runtime)
        self.inline = for_device(runtime.cfg.device, self.inline_step_ms)
        self.runtime = runtime
        await self.host.set_ready()

    def _submit(self, fn, *args) -> asyncio.Future:
        future = asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)
        self.inline.num_submitted += 1
        future.add_done_callback(self._collected)
        return future

    def _collected(self, _future: asyncio.Future) -> None:
        self.inline.num_submitted -= 1

    def run_soon(self, fn, *args) -> None:
        """Runtime work no answer waits for: inline when `InlineSteps` allows, else on the
        worker (where the next batch queues behind it)."""
        if self.inline.allow():
            fn(*args)
        else:
            self._submit(fn, *args).add_done_callback(log_failure)

    async def _step(self, runtime, stream: StreamOwner, chunks: list):
        """One batch's answer: inline when `InlineSteps` allows, else on the worker."""
        timed = self.metrics.timed(self._answer)
        self.before_step(runtime)
        started = time.perf_counter()
        if self.inline.allow():
            answer = timed(runtime, stream, chunks)
        else:
            answer = await self._submit(timed, runtime, stream, chunks)
        self.inline.observe(time.perf_counter() - started)
        return answer

    # -- hooks ---------------------------------------------------------------------------------
    def info(self, runtime):
        raise NotImplementedError

    def run_batch(self, runtime, stream: StreamOwner, chunks: list) -> list:
        raise NotImplementedError

    def before_step(self, runtime) -> None:
        """Called as a batch arrives, before it waits for the worker; nothing by default."""

    def hold(self, runtime, chunks: list) -> Hold | None:
        """What a batch waits for before it runs, off the step thread (the target's grammar
        compiles); None (run it in turn) by default."""
        return None

    def follow_up(self, runtime, stream: StreamOwner) -> Callable[[], object] | None:
        """What runs once a batch of ``stream``'s is answered, its write started (the draft's
        pre-drafting, the target's run-ahead); None (nothing) by default."""
        return None

    def occupancy(
        self, runtime, num_requests: int, kv_slots: tuple[int, int]
    ) -> common_pb2.Occupancy:
        return common_pb2.Occupancy(
            num_requests=num_requests,
            num_streams=len(self.owners.streams),
            kv_slots_used=kv_slots[0],
            kv_slots_free=kv_slots[1],
        )

    # -- RPCs ----------------------------------------------------------------------------------
    async def GetInfo(self, request, context):
        return self.info(await self._ready(context))

    async def Step(self, request_iterator, context) -> None:
        """Answers are written in order. One with work to follow (`follow_up`: the target's
        run-ahead, the draft's pre-drafting) is started before that work takes the loop, and
        awaited only before the next is written: a write costs about 0.1 ms of gRPC round trips
        through the event loop (timed in both processes on the hop benchmark), which would
        otherwise delay that work on every round. One without is written at once (no task and
        no turn of the loop before it starts). A batch held back (`hold`) is answered once it
        ran, the batches behind it meanwhile (`specmesh.rpc.held_batches`)."""
        runtime = await self._ready(context)
        stream = self.owners.open(context.peer())
        answers = StepAnswers(lambda messages: _write(context, messages))
        try:
            async for chunks in step_batches(request_iterator, context):
                if self._held(runtime, stream, chunks, answers, context):
                    continue
                async with self.host.work(context):
                    answer = await self._step(runtime, stream, chunks)
                await answers.written()
                if isinstance(answer, StreamRefusedError):
                    await abort_with(context, answer)
                messages, work = frame(answer, chunks[0].batch_id), self.follow_up(runtime, stream)
                if work is None:  # nothing to overlap with the write: written before the next
                    await answers.write_now(messages)
                    continue
                answers.write(messages)
                await asyncio.sleep(0)  # the write's first step: its message is handed to gRPC
                work()
            await answers.finish()
        finally:
            answers.cancel()  # the stream ended under a write: nothing reads its outcome
            stream.closed = True
            self._submit(self._close, runtime, stream).add_done_callback(log_failure)

    def _held(
        self, runtime, stream: StreamOwner, chunks: list, answers: StepAnswers, context
    ) -> bool:
        """Whether the batch is held back: the service holds it (`hold`), or it names a request
        of a held batch. A held batch runs as a task of its own, which writes its answer (a
        handshake, the one answer that can end the stream, is never held)."""
        hold = self.hold(runtime, chunks)
        behind = answers.behind(batch_rids(chunks[0])) if answers.held else []
        if hold is None and not behind:
            return False

        async def run() -> list | None:
            async with self.host.work(context):
                if stream.closed:  # its cleanup is queued: this batch creates nothing
                    return None
                return await self._step(runtime, stream, chunks)

        answers.hold(hold or Hold(batch_rids(chunks[0])), behind, run, chunks[0].batch_id)
        return True

    # -- worker thread ---------------------------------------------------------------------------
    def _answer(self, runtime, stream: StreamOwner, chunks: list):
        try:
            if chunks[0].WhichOneof("work") == "release":
                return self._release(runtime, stream, list(chunks[0].release.request_ids))
            return self.run_batch(runtime, stream, chunks)
        except StreamRefusedError as e:
            return e
        except Exception as e:  # the whole batch fails; the stream and the service live on
            if not isinstance(e, (SpecmeshError, ValueError)):
                log.exception("%s: step failed", self.host.service_name)
            return [self.response_type(status=status_pb(e))]

    def _release(self, runtime, stream: StreamOwner, rids: list[str]) -> list:
        for rid in rids:
            self.owners.release(stream, rid, runtime.release)
        results = [self.result_type(request_id=rid) for rid in rids]
        return [self.response_type(results=results)]

    def _close(self, runtime, stream: StreamOwner) -> None:
        freed = self.owners.close(stream, runtime.release)
        if freed:
            log.info(
                "%s: stream from %s ended; freed its %d requests",
                self.host.service_name,
                stream.peer,
                freed,
            )

    async def _ready(self, context: grpc.aio.ServicerContext):
        if self.runtime is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.host.service_name} is still loading"
            )
        return self.runtime


async def _write(context: grpc.aio.ServicerContext, messages: list) -> None:
    for msg in messages:
        await context.write(msg)


def log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("background runtime work failed", exc_info=future.exception())


async def start_model(
    servicer: ModelServicer,
    add_to_server,
    runtime,
    warm_up=None,
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    """Register, listen, warm up ``runtime`` and turn ready (tests start services this way)."""
    add_servicer(add_to_server, servicer, servicer.host.server)
    await servicer.host.start(credentials)
    await servicer.attach(runtime, warm_up)


async def serve_model(
    servicer: ModelServicer,
    add_to_server,
    load,
    warm_up,
    *,
    grace_s: float = 10.0,
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    """Process entry of a model service: listen at once (liveness), load and warm up in a
    thread (then readiness), serve until SIGTERM / SIGINT, drain, stop."""
    host = servicer.host
    add_servicer(add_to_server, servicer, host.server)
    await host.start(credentials)
    tls = "TLS" if credentials is not None else "plaintext"
    log.info("%s listening on %s (%s, at most %d connections); loading", host.service_name,
             host.address, tls, host.max_connections)  # fmt: skip
    await servicer.attach(await asyncio.to_thread(load), warm_up)
    with frozen_startup_heap(host.service_name):
        log.info("%s ready on port %d", host.service_name, host.port)
        await host.run_until_signal(grace_s)
