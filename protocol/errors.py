"""Errors a caller can act on. Each maps to one gRPC status code (see `GRPC_CODE_NAMES`)."""

from __future__ import annotations


class SpecmeshError(Exception):
    grpc_code = "INTERNAL"


class InvalidRequestError(SpecmeshError, ValueError):
    """Bad user input: out-of-vocabulary ids, empty or too-long prompts, bad sampling values.
    ``param``: the request field at fault where one is, as the HTTP API names it
    (``tools[1].function.parameters``); that API answers it as the error's ``param``."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(SpecmeshError, KeyError):
    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(SpecmeshError):
    grpc_code = "ALREADY_EXISTS"


class KVCacheFullError(SpecmeshError):
    """Not enough free KV slots; the scheduler queues or preempts, never crashes."""

    grpc_code = "RESOURCE_EXHAUSTED"


class ServiceDownError(SpecmeshError):
    """A replica did not answer (connection lost, deadline passed). Maps to UNAVAILABLE when no
    other replica can take over."""

    grpc_code = "UNAVAILABLE"


def as_specmesh_error(error: Exception, rid: str) -> SpecmeshError:
    """``error`` as a per-request status: a `SpecmeshError` as it is, a `ValueError` as
    INVALID_ARGUMENT, anything else INTERNAL with the request named (a bug, or hostile input no
    check caught)."""
    if isinstance(error, SpecmeshError):
        return error
    if isinstance(error, ValueError):  # codec and shape checks
        return InvalidRequestError(f"request {rid!r}: {error}")
    return SpecmeshError(f"request {rid!r}: internal error: {type(error).__name__}: {error}")
