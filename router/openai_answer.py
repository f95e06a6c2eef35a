"""A request's answer: the whole response once every choice ended (aborted if the client goes
away first), or its SSE stream; with the per-request speculative figures where asked
(`openai_spec`: in the response, or in the stream's final usage chunk)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from specmesh.router.openai_errors import reported
from specmesh.router.openai_spec import response_metrics
from specmesh.router.openai_stream import merge, sse_event, sse_response, unless_disconnected

if TYPE_CHECKING:
    from specmesh.router.openai_api import OpenAIService
    from specmesh.router.openai_schema import SamplingBody
    from specmesh.router.openai_views import Choice

Extra = Callable[[], dict]  # fields of the last object, computed once every choice ended


async def answer(
    api: OpenAIService, http: HttpRequest, choices: list[Choice], view, body: SamplingBody
) -> Response:
    extra = partial(response_metrics, choices, api.spec_level(body), api.num_spec_tokens)
    if body.stream:
        usage = "every" if body.continuous_usage else "last" if body.include_usage else ""
        return sse_response(stream(api, choices, view, usage, extra))
    await unless_disconnected(http, run(api, choices))
    return JSONResponse({**view.response(choices), **extra()})


async def run(api: OpenAIService, choices: list[Choice]) -> None:
    async for i, chunk in merge([api.core.generate(c.req) for c in choices]):
        choices[i].add(chunk)


async def stream(
    api: OpenAIService, choices: list[Choice], view, usage: str, extra: Extra
) -> AsyncIterator[str]:
    """SSE events: the choices' chunks as they come, the usage chunk if asked (``usage``
    "last"; "every": also on every chunk, vLLM's ``continuous_usage_stats``) with ``extra``,
    [DONE]. An error after the headers went out is sent as an error event."""
    include_usage = bool(usage)
    try:
        async with api.work():
            for c in choices:
                if first := view.first_chunk(c):
                    yield sse_event(first, include_usage)
            async for i, chunk in merge([api.core.generate(c.req) for c in choices]):
                choices[i].add(chunk)
                event = view.chunk(choices[i], chunk)
                if event is None:  # held back (a tool call is parsed once it is whole)
                    continue
                if usage == "every":
                    event["usage"] = view.usage(choices)
                yield sse_event(event, include_usage)
        if include_usage:
            last = {**view.header("chunk"), "choices": [], "usage": view.usage(choices)}
            yield sse_event({**last, **extra()}, True)
    except Exception as e:  # the status line is gone: report it in the stream
        error = reported(e, "a streamed request")
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"
