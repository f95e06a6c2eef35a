"""Request bytes that do not parse are INVALID_ARGUMENT, not UNKNOWN, and cost one log line.

Left alone, ``grpc.aio`` answers a request whose deserializer raises with UNKNOWN ("Unexpected
<class 'DecodeError'>") and logs a full traceback, once per call: any peer that can reach a
port could flood the log. `add_servicer` registers a service through its generated
``add_*Servicer_to_server`` with every method wrapped, whatever its shape:

    deserializer    a `DecodeError` becomes a `Malformed` value instead of raising
    unary request   the call ends INVALID_ARGUMENT before the servicer sees it
    request stream  the servicer reads the stream through a check: the messages before the
                    bad one are served as usual, the bad one ends the call INVALID_ARGUMENT
                    (the servicer's ``finally`` runs, so a Step stream's requests are freed)

Each refusal goes to one `MalformedLog` per registration: one WARNING line (no traceback) per
method at most every `LOG_INTERVAL_S`, which counts the refusals it kept quiet.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 60.0  # the most one method logs malformed requests: a line per interval
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]
Admit = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


@dataclass(frozen=True)
class Malformed:
    """What a wrapped deserializer returns for bytes that do not parse."""

    error: str


class MalformedLog:
    """One WARNING line per method per `LOG_INTERVAL_S`; the refusals in between are counted
    and named by the next line. Holds one entry per registered method, so it stays small."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_s: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def note(self, method: str, peer: str, error: str) -> None:
        now = time.monotonic()
        last = self._last_s.get(method)
        if last is not None and now - last < self.interval_s:
            self._quiet[method] = self._quiet.get(method, 0) + 1
            return
        self._last_s[method] = now
        quiet = self._quiet.pop(method, 0)
        more = f" ({quiet} more since the last line)" if quiet else ""
        log.warning("%s from %s refused (INVALID_ARGUMENT): %s%s", method, peer, error, more)


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: Any) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``), with
    malformed requests answered INVALID_ARGUMENT on every method."""
    capture = _Capture()
    add_to_server(servicer, capture)
    if not capture.services:
        raise RuntimeError(f"{add_to_server.__name__} registered no method handlers")
    refusals = MalformedLog()
    for service, handlers in capture.services.items():
        strict = {name: _strict(f"/{service}/{name}", h, refusals) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, strict),))
        server.add_registered_method_handlers(service, strict)


class _Capture:
    """Stands in for the server while generated code registers its handlers (it registers the
    same dict as generic and as registered handlers; the dict is all we need)."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services[service] = handlers


def _strict(
    method: str, handler: grpc.RpcMethodHandler, refusals: MalformedLog
) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(f"the request does not parse: {e}")

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            refusals.note(method, context.peer(), request.error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return request

    async def admit_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return _each_checked(requests, context, refuse)

    kind = _kind(handler)
    admit = admit_stream if handler.request_streaming else refuse
    guarded = _guarded(getattr(handler, kind), admit)
    return handler._replace(request_deserializer=deserialize, **{kind: guarded})


def _kind(handler: grpc.RpcMethodHandler) -> str:
    """The handler field that holds its behavior (``unary_unary`` ... ``stream_stream``)."""
    requests = "stream" if handler.request_streaming else "unary"
    responses = "stream" if handler.response_streaming else "unary"
    return f"{requests}_{responses}"


async def _each_checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, refuse: Admit
) -> AsyncIterator[Any]:
    async for request in requests:
        yield await refuse(request, context)


def _guarded(behavior: Behavior, admit: Admit) -> Behavior:
    """``behavior`` with its request (or request stream) passed through ``admit`` first, in
    the same shape, so grpc calls it the same way: an async generator stays one; anything else
    becomes a coroutine (our servicers are asyncio ones; a synchronous method is a generated
    UNIMPLEMENTED stub, which returns at once)."""
    if inspect.isasyncgenfunction(behavior):

        async def responses(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            request = await admit(request, context)
            async with contextlib.aclosing(behavior(request, context)) as inner:
                async for response in inner:
                    yield response

        return responses

    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(await admit(request, context), context)
        return await result if inspect.isawaitable(result) else result

    return answer
