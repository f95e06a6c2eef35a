"""A blocking `grpc.health.v1` probe (``specmesh health``, ``specmesh up``, tests). It imports
only grpc, so a Kubernetes exec probe costs a fraction of a second, not a model stack's import."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.rpc.security import TlsFiles, client_channel

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_status(
    address: str, service: str = "", timeout_s: float = 5.0, tls: TlsFiles | None = None
) -> str:
    """What ``service`` at ``address`` reports: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" (the
    server does not know the name: NOT_FOUND), or the status code's name when the probe got no
    answer ("UNAVAILABLE", "DEADLINE_EXCEEDED", ...). A blocking probe; over TLS with ``tls``:
    its CA verifies the server, its certificate is the client certificate."""
    with client_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            return "SERVICE_UNKNOWN" if code == grpc.StatusCode.NOT_FOUND else code.name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check_health(
    address: str, service: str = "", timeout_s: float = 5.0, tls: TlsFiles | None = None
) -> bool:
    """True when ``service`` at ``address`` reports SERVING (`health_status`)."""
    return health_status(address, service, timeout_s, tls) == "SERVING"
