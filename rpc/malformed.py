"""Request bytes that do not parse are INVALID_ARGUMENT, not UNKNOWN.

``grpc.aio`` answers a request whose deserializer raises with UNKNOWN ("Unexpected <class
'DecodeError'>"), before any servicer code runs. `add_servicer` registers a service through its
generated ``add_*Servicer_to_server`` but with every unary-request method wrapped: the
deserializer turns a `DecodeError` into a `Malformed` value instead of raising, and the method
ends such a call with INVALID_ARGUMENT before the servicer sees it. Streaming requests are left
as generated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Malformed:
    """What a wrapped deserializer returns for bytes that do not parse."""

    error: str


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: Any, server: Any) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``), with
    malformed unary requests answered INVALID_ARGUMENT."""
    capture = _Capture()
    add_to_server(servicer, capture)
    if not capture.services:
        raise RuntimeError(f"{add_to_server.__name__} registered no method handlers")
    for service, handlers in capture.services.items():
        strict = {name: _strict(h) for name, h in handlers.items()}
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


def _strict(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(f"the request does not parse: {e}")

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext):
            await _refuse_malformed(request, context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)

    behavior = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_malformed(request, context)
        return await behavior(request, context)

    return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)


async def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
