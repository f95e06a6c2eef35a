"""HTTP/1.1 over raw sockets, for tests that must control what a client sends and when: a body
announced but never sent, sent in pieces, dropped halfway, or a request abandoned mid-generation.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_head(
    sock: socket.socket, method: str, path: str, headers: dict[str, str] | None = None
) -> None:
    """The request line and headers (Host added); the body is the caller's."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())


def request(
    port: int, method: str, path: str, body: bytes | dict | None = None, timeout_s: float = 30.0
) -> RawResponse:
    """One request on a fresh connection, its whole response."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body or b""
    with connect(port, timeout_s) as sock:
        send_head(sock, method, path, {"Content-Length": str(len(data)), "Connection": "close"})
        sock.sendall(data)
        return read_response(sock, head_only=method == "HEAD")


def read_response(sock: socket.socket, head_only: bool = False) -> RawResponse:
    """One response (Content-Length, chunked, or until the server closes)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed before a response head: {buf!r}")
        buf += part
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    status = int(status_line.split()[1])
    if head_only:
        return RawResponse(status, headers, b"")
    if "content-length" in headers:
        body = _read_exactly(sock, rest, int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = _read_chunked(sock, rest)
    else:
        body = rest + _read_all(sock)
    return RawResponse(status, headers, body)


def is_closed(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closed the connection within ``timeout_s`` (EOF or reset; any bytes
    it sent first are skipped)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def send_chunked_until_answered(
    sock: socket.socket, pieces: Iterable[bytes], between=None
) -> tuple[int, RawResponse | None]:
    """Send ``pieces`` as a chunked body, stopping as soon as the server answers; call
    ``between(bytes_sent)`` after each piece. Returns the bytes sent and the response (None if
    the server read the whole body without answering yet)."""
    sent = 0
    for piece in pieces:
        if select.select([sock], [], [], 0)[0]:
            return sent, read_response(sock)
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            return sent, read_response(sock)
        sent += len(piece)
        if between is not None:
            between(sent)
    if select.select([sock], [], [], 0)[0]:
        return sent, read_response(sock)
    sock.sendall(b"0\r\n\r\n")
    return sent, None


def _fill(sock: socket.socket, buf: bytes, size: int) -> bytes:
    """``buf`` and what the socket sends next, until it holds at least ``size`` bytes."""
    while len(buf) < size:
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed after {len(buf)} of {size} bytes")
        buf += part
    return buf


def _read_exactly(sock: socket.socket, buf: bytes, size: int) -> bytes:
    return _fill(sock, buf, size)[:size]


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while part := sock.recv(65536):
        out += part
    return out


def _read_chunked(sock: socket.socket, buf: bytes) -> bytes:
    body = b""
    while True:
        while b"\r\n" not in buf:
            buf = _fill(sock, buf, len(buf) + 1)
        size_line, _, buf = buf.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        buf = _fill(sock, buf, size + 2)  # the chunk and its CRLF (the last: no trailers)
        if size == 0:
            return body
        body, buf = body + buf[:size], buf[size + 2 :]
