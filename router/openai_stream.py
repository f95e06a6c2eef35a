"""Streaming plumbing of the HTTP API: merging several requests' chunk streams, SSE events,
cancelling work when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from specmesh.router.openai_errors import ClientGone
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


async def unless_disconnected(http: HttpRequest, work: Awaitable[None]) -> None:
    """Run ``work``; cancel it the moment the client goes away (non-streaming responses).

    Once the body is read, the server's ``receive`` answers only ``http.disconnect``, when the
    connection closes: awaiting it costs nothing and wakes at once (no polling). It needs the
    raw ``receive``: a `BaseHTTPMiddleware` in front would hide the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone("before its response")
        task.result()
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def _disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse_event(obj: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in obj:
        obj = {**obj, "usage": None}
    return f"data: {json.dumps(obj)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)
