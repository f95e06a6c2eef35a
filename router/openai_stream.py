"""Streaming plumbing of the HTTP API: merging several requests' chunk streams, SSE events,
cancelling work when the client goes away, and reading a size-capped JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pydantic
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from specmesh.router.openai_schema import OpenAIError
from specmesh.router.request import Chunk


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """``(stream index, chunk)`` as the streams produce them; the first error raises. Closing
    the merge (or an error) closes every stream, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(http: HttpRequest, work) -> None:
    """Run ``work``; cancel it if the client goes away first (non-streaming responses)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await http.is_disconnected():
                raise OpenAIError(499, "the client closed the connection", code="cancelled")
        task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def sse_event(obj: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in obj:
        obj = {**obj, "usage": None}
    return f"data: {json.dumps(obj)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def read_body(http: HttpRequest, model: type[pydantic.BaseModel], limit: int):
    """The JSON body as ``model``: 413 past ``limit`` bytes (from Content-Length, else while
    reading), 400 when it does not parse or validate."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    data = bytearray()
    async for part in http.stream():
        data += part
        if len(data) > limit:
            raise _too_large(len(data), limit)
    try:
        return model.model_validate_json(bytes(data))
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise OpenAIError(
            400, f"invalid request body: {param}: {first['msg']}", param=param
        ) from None


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"request body of {size} bytes exceeds the limit of {limit} (derived from "
        "--max-prompt-bytes, --max-images-per-request and --max-image-bytes)",
        code="request_too_large",
    )  # fmt: skip


# -- the app and its server ----------------------------------------------------------------------
