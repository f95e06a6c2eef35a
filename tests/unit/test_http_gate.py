"""The HTTP connection cap's arithmetic and choices (issue 54, item 4), on socket pairs: how
many connections fit an fd limit, which connection is shut to make room, when the listener
waits for evicted sockets to close and when it refuses; and the fd limit raised at start. The
whole path under a real fd limit: tests/e2e/test_router_fd_limit.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from specmesh.router.http_gate import ConnectionGate, CountedSocket
from specmesh.router.limits import http_connection_cap

Pair = tuple[CountedSocket, socket.socket]  # the server's end, counted; the client's end


@pytest.fixture
def make_pair() -> Iterator[Callable[[], Pair]]:
    made: list[Pair] = []

    def make() -> Pair:
        server, client = socket.socketpair()
        made.append((CountedSocket(fileno=server.detach()), client))
        return made[-1]

    yield make
    for server, client in made:
        server.close()
        client.close()


def test_the_cap_leaves_a_quarter_of_the_fd_limit_or_64() -> None:
    assert http_connection_cap(1024) == 768
    assert http_connection_cap(256) == 192
    assert http_connection_cap(128) == 64
    assert http_connection_cap(64) == 32


def test_the_longest_waiting_connection_makes_room_then_the_listener_waits(
    make_pair: Callable[[], Pair],
) -> None:
    gate = ConnectionGate(16)  # 14 connections + 2 sockets of headroom
    assert (gate.max_connections, gate.headroom) == (14, 2)
    conns = [make_pair() for _ in range(14)]
    for server, _ in conns:
        assert gate.should_accept() is True
        gate.admit(server)
    for server, _ in conns[:3]:
        gate.serve(server)  # a request runs on the three oldest: they are not evicted
    assert gate.should_accept() is True
    newcomer, _ = make_pair()
    gate.admit(newcomer)
    fourth_client = conns[3][1]
    assert fourth_client.recv(1) == b"" and gate.num_evicted == 1  # shut down: EOF
    assert gate.should_accept() is True  # 15 open < 14 + 2
    gate.admit(make_pair()[0])
    assert gate.should_accept() is None  # 16 open: wait until the evicted ones are closed
    conns[3][0].close()
    conns[4][0].close()
    assert (len(gate.sockets), gate.num_evicted) == (14, 0)
    assert gate.should_accept() is True


def test_with_nothing_waiting_and_nothing_closing_the_listener_refuses(
    make_pair: Callable[[], Pair],
) -> None:
    gate = ConnectionGate(8)
    for _ in range(gate.max_connections):
        server, _ = make_pair()
        gate.admit(server)
        gate.serve(server)
    assert gate.should_accept() is False
    server, _ = make_pair()
    gate.wait(server)  # not one of the gate's: ignored
    assert gate.should_accept() is False


def test_the_soft_fd_limit_is_raised_to_the_hard_one() -> None:
    code = "from specmesh.router.limits import raise_fd_limit; print(raise_fd_limit())"
    out = subprocess.run(
        ["/bin/sh", "-c", 'ulimit -S -n 100 && ulimit -H -n 512 && exec "$@"', "sh",
         sys.executable, "-c", code],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["512"], out
