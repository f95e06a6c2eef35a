"""``specmesh up``'s ports and pass-through flags, with the real command lines it builds (the
processes are not started, as in `test_up_metrics`): each ``--router-arg`` / ``--target-arg`` /
``--draft-arg`` reaches its service, a ``--service-arg`` only the model services that take it, a
flag no service takes is refused by name before anything starts; a router port that is taken is a
clear error and never "ready"; a port whose last connections wait in TIME_WAIT is free, as the
servers bind it (``SO_REUSEADDR``)."""

from __future__ import annotations

import socket

import pytest
from up_harness import up

from specmesh import cluster


def test_each_flag_reaches_its_service(started) -> None:
    flags = ["--router-arg=--speculation=always", "--target-arg=--dtype", "--target-arg=fp32"]
    flags += ["--draft-arg=--topk=3", "--service-arg=--num-steps=3", "--service-arg=--device=cpu"]
    assert up(*flags) == 0
    (target,), (draft,), (router,) = started["target"], started["draft"], started["router"]
    assert router[-1] == "--speculation=always" and "--num-steps=3" not in router
    assert target[-3:] == ["--dtype", "fp32", "--device=cpu"]
    assert "--num-steps=3" not in target  # draft-only: the target would exit on it
    assert draft[-3:] == ["--topk=3", "--num-steps=3", "--device=cpu"]


@pytest.mark.parametrize(
    "flag,words",
    [
        ("--router-arg=--no-such-flag", "--router-arg --no-such-flag: no router takes"),
        ("--service-arg=--speculation=always", "no target or draft takes"),
        ("--target-arg=--port=9", "sets it for the target itself"),
        ("--draft-arg=--revision=abc", "sets it for the draft itself"),  # --draft-revision
    ],
)
def test_a_flag_no_service_takes_is_refused_by_name(started, capsys, flag, words) -> None:
    assert up(flag) == 2
    assert words in capsys.readouterr().err and not started


def test_a_taken_router_port_is_an_error_not_ready(started, capsys) -> None:
    with socket.socket() as other:  # another cluster's router
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert up("--port", str(port)) == 2
    out = capsys.readouterr()
    assert f"router port 127.0.0.1:{port} is taken" in out.err and "ready" not in out.out
    assert not started


def test_a_port_in_time_wait_is_free() -> None:
    """The server closes first (as a router stopping with keep-alive clients does): its side of
    the connection waits in TIME_WAIT on the port, which a bind without SO_REUSEADDR refuses."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's close comes first
        client.recv(1)
        client.close()
    assert cluster._port_free("127.0.0.1", port)
