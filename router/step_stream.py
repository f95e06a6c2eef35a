"""The client side of one bidirectional Step stream (target or draft).

Every batch gets a stream-unique ``batch_id``; its chunks are written back to back (a write
lock keeps batches from interleaving, and a caller that gives up never leaves half a batch) and
a reader task matches each reassembled answer to the waiting caller by id, so several
micro-batches can be in flight on one stream. `send` writes a batch nobody waits for (a
release): in order behind everything sent before, its answer dropped. A broken stream fails
every waiting batch and is forgotten; the next request opens a fresh one, starting with the
handshake when one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable

import grpc

from specmesh.protocol.errors import ServiceDownError
from specmesh.rpc.wire import FramingError, Reassembler, error_from_rpc, frame

_BROKEN = (grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError)


class CountingChannel:
    """The channel a generated stub is built on, counting the serialized bytes of its streaming
    calls (the Step stream): the stub's own serializer and deserializer are wrapped, so each
    message is serialized once and counted where its bytes are made or read. Unary calls
    (GetInfo) pass through uncounted."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        on_sent: Callable[[int], None],
        on_received: Callable[[int], None],
    ) -> None:
        self.channel, self.on_sent, self.on_received = channel, on_sent, on_received

    def unary_unary(self, *args, **kwargs):
        return self.channel.unary_unary(*args, **kwargs)

    def stream_stream(self, method: str, request_serializer, response_deserializer, **kwargs):
        def serialize(message) -> bytes:
            data = request_serializer(message)
            self.on_sent(len(data))
            return data

        def deserialize(data: bytes):
            self.on_received(len(data))
            return response_deserializer(data)

        return self.channel.stream_stream(
            method, request_serializer=serialize, response_deserializer=deserialize, **kwargs
        )


class StepStream:
    """One bidi Step stream: `request` sends a batch's chunks and returns its answer's chunks;
    `send` writes a batch whose answer nobody awaits. ``handshake`` (when set) makes the first
    message of every new stream."""

    def __init__(self, open_call, peer: str, timeout_s: float | None) -> None:
        self.open_call, self.peer, self.timeout_s = open_call, peer, timeout_s
        self.handshake: Callable[[], object] | None = None
        self.call = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.write_lock = asyncio.Lock()
        self.reader: asyncio.Task | None = None

    async def request(self, messages: list) -> list:
        return await (await self.submit(messages))

    async def submit(self, messages: list) -> Awaitable[list]:
        """Write a batch now, in order behind everything sent before; what it returns gives the
        answer's chunks and must be awaited (the batch's place among the waiting ones is freed
        there). A step sent ahead of the round that reads it (`RoundRunner`) goes this way."""
        batch_id = next(self.ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending[batch_id] = future
        timer = None
        if self.timeout_s is not None:  # a timer, not wait_for: no task or waiter per step
            timer = loop.call_later(self.timeout_s, self._expire, future)
        try:
            write = self._write(messages, batch_id, open_stream=True)
            # A caller that gives up (a draft deadline) must never leave half a batch: a batch
            # of several chunks is written by a shielded task. One message is written whole or
            # not at all, so it needs neither the task nor the shield.
            await (write if len(messages) == 1 else asyncio.shield(write))
        except BaseException:
            self._forget(batch_id, future, timer)
            raise
        return self._answer(batch_id, future, timer)

    async def _answer(self, batch_id: int, future: asyncio.Future, timer) -> list:
        try:
            return await future
        except TimeoutError:
            self._break(ServiceDownError(f"{self.peer}: no answer within {self.timeout_s:.0f} s"))
            raise ServiceDownError(f"{self.peer}: step timed out") from None
        finally:
            self._forget(batch_id, future, timer)

    def _forget(self, batch_id: int, future: asyncio.Future, timer) -> None:
        if timer is not None:
            timer.cancel()
        self.pending.pop(batch_id, None)
        if future.done() and not future.cancelled():
            future.exception()  # mark retrieved: a failed write already raised the error

    @staticmethod
    def _expire(future: asyncio.Future) -> None:
        if not future.done():
            future.set_exception(TimeoutError())

    async def send(self, messages: list, *, open_stream: bool = False) -> None:
        """Write a batch in order behind everything sent so far, its answer dropped; no stream,
        nothing to do (a release: the service freed what the ended stream held), unless
        ``open_stream``."""
        await asyncio.shield(self._write(messages, next(self.ids), open_stream=open_stream))

    async def _write(self, messages: list, batch_id: int, *, open_stream: bool) -> None:
        async with self.write_lock:
            if self.call is None and not open_stream:
                return
            try:
                call = await self._open()
                for msg in frame(messages, batch_id):
                    await call.write(msg)
            except grpc.RpcError as e:
                raise self._break(_write_error(e, self.peer)) from None
            except _BROKEN as e:
                raise self._break(ServiceDownError(f"{self.peer}: stream broken: {e}")) from None

    async def _open(self):
        if self.call is None:
            self.call = self.open_call()
            self.reader = asyncio.create_task(self._read(self.call))
            if self.handshake is not None:  # its answer is dropped; a refusal ends the stream
                await self.call.write(frame([self.handshake()], next(self.ids))[0])
        return self.call

    async def _read(self, call) -> None:
        reassembler = Reassembler()
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise ServiceDownError(f"{self.peer}: the service closed the stream")
                chunks = reassembler.add(msg)
                future = self.pending.get(chunks[0].batch_id) if chunks else None
                if future is not None and not future.done():
                    future.set_result(chunks)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as e:
            self._break(error_from_rpc(e, self.peer), call)
        except (ServiceDownError, FramingError) as e:
            self._break(ServiceDownError(str(e)), call)

    def _break(self, error: Exception, call=None) -> Exception:
        """Fail every waiting batch and forget the stream; the next request opens a new one."""
        if call is not None and call is not self.call:
            return error  # an old stream's reader, already replaced
        if self.call is not None:
            self.call.cancel()
        self.call = None
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        return error

    async def close(self) -> None:
        self._break(ServiceDownError(f"{self.peer}: client closed"))
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


def _write_error(e: grpc.RpcError, peer: str) -> Exception:
    """What a failed write means. gRPC reports a connection that died under the write (a killed
    service) as INTERNAL ("Internal error from Core"), ahead of the call's own status: the
    service is gone, as with UNAVAILABLE, and the batch's requests are replayed elsewhere. A
    status the service ended the stream with (a refused handshake) keeps its meaning."""
    if e.code() == grpc.StatusCode.INTERNAL:
        return ServiceDownError(f"{peer}: the stream broke under a write ({e.details()})")
    return error_from_rpc(e, peer)
