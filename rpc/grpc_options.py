"""The gRPC options of the project's servers and channels: keepalive, reconnects, message
sizes, and how many connections a server holds (`connection_cap`)."""

from __future__ import annotations

import resource

from specmesh.protocol.codec import GRPC_MAX_MESSAGE_BYTES, grpc_message_options

# Servers accept pings as often as clients send them (clients ping every 30 s, idle or not).
# Without this a long idle stream gets GOAWAY "too_many_pings" (the default minimum is 5 min).
# SO_REUSEPORT off: a second process asking for a live port fails instead of sharing it.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# A connection must finish its TLS / HTTP/2 handshake within this (grpc's default is 120 s): one
# that sends nothing holds a slot of the port's connection cap (`connection_cap`) only this long
HANDSHAKE_TIMEOUT_MS = 10_000
# A connection without a call this long is sent GOAWAY (its client reconnects at its next call,
# transparently): idle connections do not keep the cap's slots
IDLE_TIMEOUT_MS = 300_000
# Fast reconnects: a restarted replica is usable again within ~1 s, not after a 120 s backoff.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def server_options(max_message_bytes: int, max_connections: int) -> list[tuple[str, int]]:
    """A service's server: ``max_connections`` at once (grpc closes one more as it is accepted,
    and its client sees UNAVAILABLE), each with `HANDSHAKE_TIMEOUT_MS` to finish its handshake
    and closed after `IDLE_TIMEOUT_MS` without a call."""
    limits = [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", IDLE_TIMEOUT_MS),
    ]
    return grpc_message_options(max_message_bytes) + SERVER_OPTIONS + limits


def channel_options(max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return grpc_message_options(max_message_bytes) + CHANNEL_OPTIONS


def connection_cap() -> int:
    """A model service's connections: half its soft limit of open files (the rest stays for its
    files and its own clients); its clients are routers, a few connections each."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, (1 << 20 if soft == resource.RLIM_INFINITY else soft) // 2)
