"""HTTP connections (issue 54), over the real HTTP server on loopback.

Refusals that clients can read (item 3): a client that sends its whole body before it reads (Python's http.client and urllib do) gets the
413 and its JSON message, every time, whether the body was refused by its declared length or
in the middle of a chunked upload; the router keeps serving. Before the staged close the server
closed with the body's bytes unread, the kernel sent a reset, and the client saw
ConnectionResetError instead of the answer.

Deadlines before a request (item 4): a connection that sends nothing is closed sooner than one
whose head is on its way. The connection cap under a low fd limit needs a process of its own:
``tests/e2e/test_router_fd_limit.py``."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from grpc_harness import serve_router, wait_until
from http_raw import connect, is_closed, read_response, request, send_head

from specmesh.router.http_protocol import LINGER_IDLE_S
from specmesh.router.limits import RouterLimits
from specmesh.router.server import RouterService

BODY_BYTES = 20_000_000
PIECE = 256 << 10
HEADS = {
    "/v1/completions": (b'{"model": "target", "max_tokens": 1, "prompt": [', b"1, "),
    "/v1/chat/completions": (
        b'{"model": "target", "max_tokens": 1, "messages": [',
        b'{"role": "user", "content": "hi"}, ',  # counted separators refuse it midway
    ),
}


@pytest.fixture(scope="module")
def router(stack) -> Iterator[RouterService]:
    router = stack.loop.run(serve_router(stack.target, stack.draft, http_port=0))
    yield router
    stack.loop.run(router.stop(0.5))


@pytest.fixture
def port(router: RouterService) -> int:
    return router.http_port


def _pieces(path: str) -> Iterator[bytes]:
    """About ``BODY_BYTES`` of a JSON body too large for ``path``, in ``PIECE``-sized parts."""
    head, item = HEADS[path]
    yield head
    piece = item * (PIECE // len(item))
    for _ in range(BODY_BYTES // len(piece)):
        yield piece
    yield item.rstrip(b", ") + b"]}"


def _post(port: int, path: str, chunked: bool) -> tuple[int, dict]:
    """http.client sends the whole body (Content-Length, or chunked from an iterator), then
    reads the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = _pieces(path) if chunked else b"".join(_pieces(path))
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "chunked"),
    [("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", True)],
    ids=["declared", "chunked", "chat_chunked"],
)
def test_a_refused_body_is_answered_to_a_client_that_sends_it_all(
    port: int, path: str, chunked: bool
) -> None:
    for _ in range(3):
        status, answer = _post(port, path, chunked)
        assert status == 413, answer
        assert answer["error"]["code"] == "request_too_large", answer
        assert "exceeds the limit of" in answer["error"]["message"], answer
    assert request(port, "GET", "/health").status == 200


def test_a_refused_client_that_stops_sending_is_closed(router: RouterService) -> None:
    """The staged close is bounded: the client reads the 413 and EOF at once (the write side is
    shut), and a client that then neither sends nor closes is closed once it stays quiet."""
    connections = router.http.server.server_state.connections
    with connect(router.http_port) as sock:
        send_head(sock, "POST", "/v1/completions", {"Content-Length": str(BODY_BYTES)})
        sock.sendall(b'{"model": "target", "prompt": [1, 2')
        assert read_response(sock).status == 413
        assert sock.recv(1) == b""  # EOF, not a reset, with the body still owed
        sock.sendall(b", 3" * 1000)  # still read (and dropped) by the server
        assert wait_until(lambda: not connections, LINGER_IDLE_S + 10), len(connections)
    assert request(router.http_port, "GET", "/health").status == 200


def test_a_connection_that_sends_nothing_is_closed_before_a_slow_head(stack) -> None:
    limits = RouterLimits(http_first_byte_timeout_s=0.5, http_header_timeout_s=6)
    router = stack.loop.run(
        serve_router(stack.target, stack.draft, http_port=0, settings={"limits": limits})
    )
    try:
        with connect(router.http_port) as silent, connect(router.http_port) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\n")  # a head on its way, never finished
            assert is_closed(silent, 5)  # its first-byte deadline: 0.5 s
            assert not is_closed(slow, 0.1)  # its head's deadline: 6 s
            assert is_closed(slow, 20)
        assert request(router.http_port, "GET", "/health").status == 200
    finally:
        stack.loop.run(router.stop(0.5))
