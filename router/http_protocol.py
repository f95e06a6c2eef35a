"""One HTTP connection of the OpenAI API: uvicorn's h11 protocol with deadlines before each
request and a staged close after a refusal.

Deadlines, from when a connection opens (or its previous response ends) to the end of its
request head; uvicorn's keep-alive timer starts only after a response and any byte resets it, so
without them a connection sending nothing, or a header byte now and then, would stay forever:

    http_first_byte_timeout_s   a connection that has sent nothing is closed (a port scan, a
                                client opening connections it does not use, a flood)
    http_header_timeout_s       the request line and headers, however they trickle in

While it waits for a head, a connection is one the gate may shut when connections run short,
the longest waiting first (`http_gate.ConnectionGate`).

Staged close (RFC 9112 §9.6). A response that ends the connection while its request body is
still coming (413 on a declared or counted size, 408, a malformed request) is not followed by a
plain close: the client's bytes still unread in the server's socket make the kernel answer with
a reset, and a reset discards the response the client has not read yet (Python's http.client
sends a whole body before it reads: it got ConnectionResetError instead of the 413). Instead:

    response flushed, write side shut     the client reads the response, then EOF
    the rest of the body read, dropped    never parsed nor kept; until the client closes,
                                          LINGER_MAX_BYTES, LINGER_IDLE_S without a byte, or
                                          LINGER_MAX_S in all
    closed
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from specmesh.router.http_gate import ConnectionGate, CountedSocket
from specmesh.router.limits import RouterLimits

log = logging.getLogger(__name__)

LINGER_MAX_S = 10.0
LINGER_IDLE_S = 2.0
LINGER_MAX_BYTES = 64 << 20
BODY_STILL_COMING = (h11.SEND_BODY, h11.ERROR)  # the client's state when a close must linger


class ServerConfig(uvicorn.Config):
    """uvicorn's config, with what every connection of one server shares."""

    def __init__(
        self, app: ASGIApp, *, limits: RouterLimits, gate: ConnectionGate, **kwargs: Any
    ) -> None:
        super().__init__(app, http=HttpConnection, **kwargs)
        self.limits, self.gate = limits, gate


class _StagedClose:
    """The transport as uvicorn sees it: ``close`` is the connection's staged close, and the
    connection counts as closing from then on (so no keep-alive timer starts)."""

    def __init__(self, transport: asyncio.Transport, connection: HttpConnection) -> None:
        self._transport, self._connection = transport, connection

    def close(self) -> None:
        self._connection.close_staged()

    def is_closing(self) -> bool:
        return self._connection.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpConnection(H11Protocol):
    config: ServerConfig
    _raw: asyncio.Transport
    _sock: CountedSocket | None = None  # as the gate counts it
    _head_timer: asyncio.TimerHandle | None = None
    _waiting_since = 0.0  # loop time the wait for the current request head began
    _sent_a_byte = False  # since then
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_until = 0.0  # loop time the staged close ends at the latest
    _linger_last = 0.0  # loop time of the last byte drained
    _linger_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        sock = transport.get_extra_info("socket")
        self._sock = self.config.gate.sockets.get(sock.fileno()) if sock is not None else None
        self.transport = _StagedClose(transport, self)  # type: ignore[assignment]
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._drain(len(data))
            return
        self._sent_a_byte = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._serving():  # a head arrived: its request runs
            self._head_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        if not self.transport.is_closing() and not self._serving():
            self._await_head()  # the rest of an unread body counts against it too

    # -- deadlines before a request --------------------------------------------------------------
    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._head_arrived()
        self._waiting_since, self._sent_a_byte = self.loop.time(), False
        self.config.gate.wait(self._sock)
        limits = self.config.limits
        first_s = min(limits.http_first_byte_timeout_s, limits.http_header_timeout_s)
        self._head_timer = self.loop.call_later(first_s, self._head_deadline)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.config.gate.serve(self._sock)

    def _head_deadline(self) -> None:
        self._head_timer = None
        header_s = self.config.limits.http_header_timeout_s
        left_s = self._waiting_since + header_s - self.loop.time()
        if self._sent_a_byte and left_s > 0:  # past the first byte: the whole head's deadline
            self._head_timer = self.loop.call_later(left_s, self._head_deadline)
            return
        self._head_arrived()
        if self._raw.is_closing():
            return
        if self._sent_a_byte:
            log.info("HTTP client %s sent no request head within %g s: closed", self.client,
                     header_s)  # fmt: skip
        else:  # a flood of these must not flood the log
            first_s = self.config.limits.http_first_byte_timeout_s
            log.debug("HTTP client %s sent nothing within %g s: closed", self.client, first_s)
        self._raw.close()

    # -- staged close ----------------------------------------------------------------------------
    @property
    def lingering(self) -> bool:
        return self._linger_timer is not None

    def close_staged(self) -> None:
        """uvicorn closes the connection: at once, unless a request body may still be coming;
        a second close (the server stopping) ends a staged one."""
        raw = self._raw
        if self.lingering or raw.is_closing() or self.conn.their_state not in BODY_STILL_COMING:
            raw.close()
            return
        now = self.loop.time()
        self._linger_until, self._linger_last = now + LINGER_MAX_S, now
        if raw.can_write_eof():  # TLS cannot: the client still has the response's length
            raw.write_eof()  # once the response is flushed
        self.flow.resume_reading()  # the refused body may have paused reading
        if self.cycle is not None:
            self.cycle.body = bytearray()
        self._linger_timer = self.loop.call_later(LINGER_IDLE_S, self._linger_check)

    def _drain(self, num_bytes: int) -> None:
        self._linger_bytes += num_bytes
        self._linger_last = self.loop.time()
        if self._linger_bytes > LINGER_MAX_BYTES:
            self._raw.close()

    def _linger_check(self) -> None:
        end = min(self._linger_last + LINGER_IDLE_S, self._linger_until)
        if self.loop.time() >= end:
            self._raw.close()  # the timer stays set: the connection keeps counting as closing
            return
        self._linger_timer = self.loop.call_later(end - self.loop.time(), self._linger_check)
