"""The gRPC port's connection cap (`rpc.grpc_options`): a server holds at most ``max_connections``
at once; one more is closed as it is accepted, and its client gets UNAVAILABLE at once while the
held ones keep serving; a freed slot serves the next client; a connection that sends nothing
is closed once the handshake timeout passes, and one without a call once the idle timeout
passes, so neither silent sockets nor idle channels can hold the port. The
router's cap is its share of the open-files limit (`router.limits.grpc_connection_cap`)."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_harness import LoopThread
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.router.limits import grpc_connection_cap, http_connection_cap
from specmesh.rpc import grpc_options
from specmesh.rpc.service_common import ServiceHost

CAP = 2
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def host(request, monkeypatch):
    """A service's server holding at most `CAP` connections, its handshake timeout 0.5 s; its
    idle timeout a minute (in the ``idle`` test 0.5 s)."""
    monkeypatch.setattr(grpc_options, "HANDSHAKE_TIMEOUT_MS", 500)
    idle = "idle" in request.node.name
    monkeypatch.setattr(grpc_options, "IDLE_TIMEOUT_MS", 500 if idle else 60_000)
    loop = LoopThread()

    async def start() -> ServiceHost:
        served = ServiceHost("specmesh.v1.Target", "127.0.0.1:0", max_connections=CAP)
        await served.start()
        return served

    served = loop.run(start())
    yield served
    loop.run(served.shutdown(0.0))
    loop.close()


def _channel(port: int) -> grpc.Channel:
    """A channel with a connection of its own (none shared with the test's other channels),
    reconnecting as the project's clients do (within a second)."""
    options = [*grpc_options.channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def _status(channel: grpc.Channel, wait: bool = False) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=wait).status


def test_a_connection_past_the_cap_is_refused_and_the_held_ones_serve(host) -> None:
    held = [_channel(host.port) for _ in range(CAP)]
    extra = _channel(host.port)
    try:
        assert [_status(c) for c in held] == [SERVING] * CAP
        with pytest.raises(grpc.RpcError) as e:
            _status(extra)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [_status(c) for c in held] == [SERVING] * CAP
        held.pop().close()
        assert _status(extra, wait=True) == SERVING  # in the slot that was freed
    finally:
        for c in [*held, extra]:
            c.close()


def test_silent_sockets_are_closed_after_the_handshake_timeout(host) -> None:
    silent = [socket.create_connection(("127.0.0.1", host.port)) for _ in range(CAP)]
    try:
        for s in silent:  # the server's preface, if any, then the end: the server closed it
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        channel = _channel(host.port)
        assert _status(channel, wait=True) == SERVING
        channel.close()
    finally:
        for s in silent:
            s.close()


def test_idle_channels_are_closed_after_the_idle_timeout(host) -> None:
    """`CAP` channels that made a call and then sit idle fill the port until the server closes
    them; the next client then connects, and an idle one reconnects at its next call."""
    idle = [_channel(host.port) for _ in range(CAP)]
    extra = _channel(host.port)
    try:
        assert [_status(c) for c in idle] == [SERVING] * CAP
        assert _status(extra, wait=True) == SERVING
        assert _status(idle[0], wait=True) == SERVING
    finally:
        for c in [*idle, extra]:
            c.close()


def test_the_routers_grpc_port_gets_half_of_what_http_leaves() -> None:
    for limit in (256, 1024, 1 << 20):
        assert grpc_connection_cap(limit) == (limit - http_connection_cap(limit)) // 2
    assert grpc_connection_cap(1024) == 128
