"""Request bytes that do not parse, on every method of every service (issue 54 #7): raw bytes
sent through a channel with identity serializers get INVALID_ARGUMENT, whatever the method's
shape (unary, server stream, bidirectional stream), the service keeps serving, and the log gets
one line per method at most, never a traceback (a peer inside the mesh cannot flood it)."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specmesh.v1 import common_pb2, target_pb2

GARBAGE = b"\xff\xff\xff\xff"
CODE = grpc.StatusCode
IDENTITY = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
HEALTH = "/grpc.health.v1.Health"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

# (service fixture attribute, method path, grpc multicallable kind)
METHODS = [
    ("target", "/specmesh.v1.Target/Step", "stream_stream"),
    ("target", "/specmesh.v1.Target/GetInfo", "unary_unary"),
    ("target", "/specmesh.v1.Target/GetTokenizer", "unary_unary"),
    ("draft", "/specmesh.v1.Draft/Step", "stream_stream"),
    ("draft", "/specmesh.v1.Draft/GetInfo", "unary_unary"),
    ("router", "/specmesh.v1.Generation/Generate", "unary_stream"),
    ("router", "/specmesh.v1.Generation/GetInfo", "unary_unary"),
    ("target", f"{HEALTH}/Check", "unary_unary"),
    ("draft", f"{HEALTH}/Watch", "unary_stream"),
    ("router", REFLECTION, "stream_stream"),
]


def _port(stack, name: str) -> int:
    service = getattr(stack, name)
    return service.port if name == "router" else service.host.port


def _call(channel: grpc.Channel, path: str, kind: str, messages: list[bytes]) -> list[bytes]:
    method = getattr(channel, kind)(path, **IDENTITY)
    if kind.startswith("stream"):
        out = method(iter(messages), timeout=10)
    else:
        out = method(messages[0], timeout=10)
    return [out] if kind == "unary_unary" else list(out)


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert "Traceback" not in caplog.text and "DecodeError" not in caplog.text, caplog.text


@pytest.mark.parametrize(("service", "path", "kind"), METHODS, ids=[m[1] for m in METHODS])
def test_bytes_that_do_not_parse_are_invalid_argument(
    stack, caplog: pytest.LogCaptureFixture, service: str, path: str, kind: str
) -> None:
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(f"127.0.0.1:{_port(stack, service)}") as channel:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                _call(channel, path, kind, [GARBAGE])
            assert e.value.code() == CODE.INVALID_ARGUMENT, e.value.details()
            assert "does not parse" in e.value.details()
        info = channel.unary_unary(f"{HEALTH}/Check", **IDENTITY)
        assert info(health_pb2.HealthCheckRequest().SerializeToString(), timeout=10)
    _no_traceback(caplog)
    lines = [r for r in caplog.records if path in r.getMessage()]
    assert len(lines) == 1, caplog.text  # three calls, one line
    assert lines[0].levelno == logging.WARNING and "does not parse" in lines[0].getMessage()


def test_a_step_stream_answers_what_parsed_then_refuses_the_garbage(stack, caplog) -> None:
    """A good release batch is answered, then the stream ends INVALID_ARGUMENT at the bytes
    that do not parse; the target serves the next stream and holds nothing."""
    caplog.set_level(logging.INFO)
    release = common_pb2.ReleaseBatch(request_ids=["ghost"])
    good = target_pb2.TargetStepRequest(batch_id=1, release=release).SerializeToString()
    path = "/specmesh.v1.Target/Step"
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.host.port}") as channel:
        method = channel.stream_stream(path, **IDENTITY)
        call = method(iter([good, GARBAGE]), timeout=10)
        answers = []
        with pytest.raises(grpc.RpcError) as e:
            for answer in call:
                answers.append(target_pb2.TargetStepResponse.FromString(answer))
        assert e.value.code() == CODE.INVALID_ARGUMENT, e.value.details()
        assert [a.batch_id for a in answers] == [1]
        assert [r.request_id for r in answers[0].results] == ["ghost"]
        again = _call(channel, path, "stream_stream", [good])
        assert target_pb2.TargetStepResponse.FromString(again[0]).batch_id == 1
    _no_traceback(caplog)
    assert not stack.target.runtime.requests


def test_a_wrapped_coroutine_stream_still_streams(stack) -> None:
    """Health/Watch writes with ``context.write`` (a coroutine, not a generator): wrapped, a
    good request still gets its statuses as they come."""
    request = health_pb2.HealthCheckRequest(service="specmesh.v1.Draft").SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.host.port}") as channel:
        call = channel.unary_stream(f"{HEALTH}/Watch", **IDENTITY)(request, timeout=10)
        first = health_pb2.HealthCheckResponse.FromString(next(call))
        call.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
