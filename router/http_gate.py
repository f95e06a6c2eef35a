"""How many HTTP connections the router keeps open. A socket counts from its accept to its close
(`GatedListener`, `CountedSocket`), so the descriptors the HTTP API holds stay bounded whatever
uvicorn and asyncio keep of a connection. With ``max_sockets`` (`limits.http_connection_cap`:
what the fd limit leaves once the rest of the router is served) = ``max_connections`` +
``headroom``, each connection the listener could accept is:

    open < max_connections     accepted
    open < max_sockets         accepted, and the socket waiting longest for a request head
                               (from its accept until its head has arrived, and between
                               requests) is shut down to make room (evicted)
    evicted ones still open    left in the kernel's queue until they are closed
    else                       refused: accepted and closed at once, nothing read

A socket shut down is closed a loop pass or two later (its connection reads EOF), and asyncio
accepts up to its whole backlog in one pass, before any connection of that pass is made: waiting
counts from the accept, and ``headroom`` bounds the sockets still open while evicted. So a flood
of idle connections leaves /health and a gRPC Generate served, with descriptors for both.

Refusals and evictions are logged the first time, then at most once a minute with their count;
so is an accept that failed for want of descriptors all the same (asyncio logs a traceback per
attempt and tries the rest of its backlog in the same pass: thousands of lines a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ACCEPT_OUT_OF_FDS = "socket.accept() out of system resource"  # asyncio's message
LOG_EVERY_S = 60.0


class Tally:
    """An event logged the first time, then at most once every ``every_s`` with the number of
    times it happened since the last line."""

    def __init__(self, message: str, every_s: float = LOG_EVERY_S) -> None:
        self.message, self.every_s = message, every_s
        self.count = 0
        self.next_log_s = 0.0

    def add(self, *args: object) -> None:
        self.count += 1
        now = time.monotonic()
        if now >= self.next_log_s:
            times = f" ({self.count} times since the last such line)" if self.count > 1 else ""
            log.warning(self.message + times, *args)
            self.count, self.next_log_s = 0, now + self.every_s


class CountedSocket(socket.socket):
    """An accepted socket: its gate counts it until it is closed."""

    gate: ConnectionGate | None = None
    evicted = False

    def close(self) -> None:
        if self.gate is not None:
            self.gate.forget(self)
            self.gate = None
        super().close()


class ConnectionGate:
    """The HTTP sockets open now (by descriptor) and those waiting for a request head (oldest
    wait first; `http_protocol.HttpConnection` says when its wait ends and starts again)."""

    def __init__(self, max_sockets: int) -> None:
        self.headroom = max(1, max_sockets // 8)
        self.max_connections = max(1, max_sockets - self.headroom)
        self.sockets: dict[int, CountedSocket] = {}
        self.waiting: dict[CountedSocket, None] = {}
        self.num_evicted = 0  # shut down, not closed yet
        limit = f"their limit of {self.max_connections} (from the fd limit)"
        self.refused = Tally(f"HTTP connection refused: connections at {limit}, none idle")
        self.evicted = Tally(
            f"HTTP connections at {limit}: shut the one waiting longest for its request"
        )
        self.out_of_fds = Tally("HTTP connections not accepted for now: %s")

    def should_accept(self) -> bool | None:
        """True: accept the next connection (`admit` it); None: not yet (evicted sockets are
        closing); False: accept it and close it."""
        num_open = len(self.sockets)
        if num_open < self.max_connections:
            return True
        if self.waiting and num_open < self.max_connections + self.headroom:
            return True
        return None if self.num_evicted else False

    def admit(self, conn: CountedSocket) -> None:
        if len(self.sockets) >= self.max_connections:
            self._evict(next(iter(self.waiting)))
        conn.gate = self
        self.sockets[conn.fileno()] = conn
        self.waiting[conn] = None

    def forget(self, conn: CountedSocket) -> None:
        """``conn`` is closing."""
        if self.sockets.get(conn.fileno()) is conn:
            del self.sockets[conn.fileno()]
        self.waiting.pop(conn, None)
        self.num_evicted -= conn.evicted

    def wait(self, conn: CountedSocket | None) -> None:
        """``conn``'s connection waits for a request head (from its accept: still)."""
        if conn is not None and conn.gate is self and not conn.evicted:
            self.waiting[conn] = None  # one already waiting keeps its place

    def serve(self, conn: CountedSocket | None) -> None:
        """``conn``'s connection got its request head (or is closing)."""
        if conn is not None:
            self.waiting.pop(conn, None)

    def _evict(self, conn: CountedSocket) -> None:
        del self.waiting[conn]
        conn.evicted = True
        self.num_evicted += 1
        with contextlib.suppress(OSError):  # the client may be gone already
            conn.shutdown(socket.SHUT_RDWR)  # its connection reads EOF and closes it
        self.evicted.add()


class GatedListener(socket.socket):
    """The listening socket asyncio accepts from: ``accept`` returns only admitted connections,
    closes refused ones at once, and raises BlockingIOError (as when no connection is queued)
    to leave the rest in the kernel's queue."""

    gate: ConnectionGate
    _out_of_fds = False  # raised EMFILE in this pass of asyncio's accept loop

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            verdict = self.gate.should_accept()
            if verdict is None:
                raise BlockingIOError(errno.EAGAIN, "evicted connections are closing")
            fd, addr = self._accept_fd()
            if verdict:
                conn = CountedSocket(self.family, self.type, self.proto, fileno=fd)
                self.gate.admit(conn)
                return conn, addr
            socket.close(fd)
            self.gate.refused.add()

    def _accept_fd(self) -> tuple[int, Any]:
        try:
            return self._accept()  # type: ignore[attr-defined]
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise  # BlockingIOError: none queued
            if self._out_of_fds:  # asyncio would try the rest of its backlog now
                raise BlockingIOError(errno.EAGAIN, "accept paused") from None
            self._out_of_fds = True  # asyncio pauses accepting for a second
            asyncio.get_running_loop().call_soon(setattr, self, "_out_of_fds", False)
            raise


def listening_socket(host: str, port: int, address: str, gate: ConnectionGate) -> GatedListener:
    """Bound with ``SO_REUSEADDR``: a router restarted after a crash binds its port at once,
    whatever its dead connections left in TIME_WAIT (Linux still refuses a port another socket
    listens on, so the port stays exclusive; ``SO_REUSEPORT`` stays off)."""
    sock = GatedListener(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.gate = gate
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {address} (HTTP): {e.strerror}") from None
    return sock


def quiet_accept_errors(
    loop: asyncio.AbstractEventLoop, gate: ConnectionGate
) -> Callable[[], None]:
    """Send asyncio's "out of system resource" accept errors to ``gate``'s tally instead of a
    traceback each; everything else to the loop's handler as before. Returns the undo."""
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_OUT_OF_FDS:
            gate.out_of_fds.add(context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def undo() -> None:
        if loop.get_exception_handler() is handle:
            loop.set_exception_handler(previous)

    loop.set_exception_handler(handle)
    return undo
