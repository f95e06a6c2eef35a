"""Admission rejections: requests the router refuses before they run, counted by reason
(vLLM's ``admission_rejections_total{reason}`` under the ``specmesh_`` prefix).

Two checks refuse requests, and `counts_rejections` decorates both, so every refusal they raise
is counted once, whichever API it came through:

    GenerationServicer._make_request   the request checks of the gRPC API and the HTTP API (one
                                       call per choice): sizes, sampling values, stop rules,
                                       grammars, the tokenizer queue, max_new_tokens vs context
    RouterCore.validate                the core's, as it takes a request: ids in the vocabulary,
                                       the prompt's length, stop rules, a free request id, room
                                       in the waiting queue (`RouterConfig.max_waiting`)

A reason is read off the error the check raised (`rejection_reason`); ``REASONS`` lists them in
the order docs/metrics.md explains them. What never becomes a request is not counted: an HTTP
body the API cannot parse (malformed JSON, unknown fields, more choices than allowed), a caller
without the API key, a router that is starting or draining.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from specmesh.protocol.errors import KVCacheFullError, SpecmeshError
from specmesh.router.limits import TokenizerBusyError

REASONS = ("invalid", "unsupported", "duplicate_id", "queue_full", "tokenizer_busy")
# By the error's status where one reason has one status; the rest by the error's class.
_BY_CODE = {
    "INVALID_ARGUMENT": "invalid",
    "FAILED_PRECONDITION": "unsupported",  # a text prompt at a router without a tokenizer
    "ALREADY_EXISTS": "duplicate_id",
}
Check = TypeVar("Check", bound=Callable[..., Any])


def rejection_reason(error: Exception) -> str:
    """The reason label of a refusal: one of ``REASONS``, or "other" for an error no check
    raises today."""
    if isinstance(error, KVCacheFullError):
        return "queue_full"  # RouterCore.validate: max_waiting requests wait already
    if isinstance(error, TokenizerBusyError):
        return "tokenizer_busy"  # --max-queued-prompts text prompts are being tokenized
    if not isinstance(error, SpecmeshError):
        return "invalid"  # a ValueError of a value check (sampling parameters)
    return _BY_CODE.get(error.grpc_code, "other")


def counts_rejections(core_param: str) -> Callable[[Check], Check]:
    """Decorate a request check (a function or a coroutine function): each `SpecmeshError` or
    `ValueError` it raises is counted, by `rejection_reason`, on the `RouterCore` passed as its
    parameter ``core_param`` (``core.metrics.on_rejected``), and raised on."""

    def decorate(check: Check) -> Check:
        signature = inspect.signature(check)

        def count(error: Exception, args: tuple, kwargs: dict) -> None:
            core = signature.bind(*args, **kwargs).arguments[core_param]
            core.metrics.on_rejected(error)

        if inspect.iscoroutinefunction(check):

            @functools.wraps(check)
            async def checked_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await check(*args, **kwargs)
                except (SpecmeshError, ValueError) as e:
                    count(e, args, kwargs)
                    raise

            return cast(Check, checked_async)

        @functools.wraps(check)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return check(*args, **kwargs)
            except (SpecmeshError, ValueError) as e:
                count(e, args, kwargs)
                raise

        return cast(Check, checked)

    return decorate
