"""Grammar compiles that are slow or past the engine's limits (issue 54, item 2), on the demo
target (fp32) and a router serving HTTP over it.

A JSON schema of 2,300 optional properties (61 KB, under the 64 KiB limit) compiles, but the
engine's mask after its forced ``{`` has 9,207 Earley items, past its 2,000: the router refuses
it at its public API (HTTP 400 / INVALID_ARGUMENT naming the limit) and the target never sees it;
sent to the target directly, the target refuses it before the request holds any KV. On a raw Step
stream, a prefill whose grammar still compiles is held back while the batches behind it (another
request's prefill and decode steps) are answered; a release behind it waits for it; and a
compile past the bound is refused with a message naming the bound. The compile is blocked on an
event that the test sets only once the other request's steps were answered, so the order of the
answers, not a clock, shows that nothing waited for it."""

from __future__ import annotations

import itertools
import json
import queue
import threading
from types import SimpleNamespace

import grpc
import openai
import pytest
from grpc_harness import LoopThread, serve_router, serve_target
from procs import occupancy

from specmesh.client import GenerationClient
from specmesh.defaults import REPO_MODELS
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.target_service import prefill
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc

# 2,300 optional integer properties: 61 KB of schema; 450 are served, 500 are refused
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2300)}}
PROMPT_IDS = [5, 6, 7, 8]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
BLOCKED_S = 15  # the most a blocked compile waits for its event (a safety net, not a measure)


@pytest.fixture(scope="module")
def demo():
    """The demo target and a router over it (no draft) serving gRPC and HTTP."""
    loop = LoopThread()
    target_dir = str(REPO_MODELS / "target")
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir, dtype="float32"))))
    router = loop.run(serve_router(target, None, http_port=0))
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-", max_retries=0
    )
    grpc_client = GenerationClient(f"127.0.0.1:{router.port}")
    channel = grpc.insecure_channel(f"127.0.0.1:{target.host.port}")
    yield SimpleNamespace(target=target, http=http, grpc=grpc_client, channel=channel)
    channel.close()
    grpc_client.close()
    http.close()
    loop.run(router.stop(0.5))
    loop.run(target.host.shutdown(0.5))
    loop.close()


@pytest.fixture
def works(demo, monkeypatch) -> list[str]:
    """The kind of every Step batch the target runs during the test."""
    seen: list[str] = []
    inner = demo.target.run_batch

    def run_batch(runtime, stream, chunks):
        seen.append(chunks[0].WhichOneof("work"))
        return inner(runtime, stream, chunks)

    monkeypatch.setattr(demo.target, "run_batch", run_batch)
    return seen


@pytest.fixture
def blocked(demo, monkeypatch) -> threading.Event:
    """Every grammar compile on the target blocks until the returned event is set (compiling
    loads the engine's tokenizer first: that call is the one held)."""
    go = threading.Event()
    grammars = demo.target.runtime.grammars
    tokenizer = grammars.tokenizer

    def slow_tokenizer():
        go.wait(BLOCKED_S)
        return tokenizer()

    monkeypatch.setattr(grammars, "tokenizer", slow_tokenizer)
    yield go
    go.set()


class RawStep:
    """One Step stream to the target, written batch by batch, its answers read one by one."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.ids = itertools.count(1)
        stub = target_pb2_grpc.TargetStub(channel)
        self.answers = stub.Step(iter(self.outbox.get, None), timeout=60)

    def send(self, msg: target_pb2.TargetStepRequest) -> int:
        msg.batch_id = next(self.ids)
        self.outbox.put(msg)
        return msg.batch_id

    def read(self) -> target_pb2.TargetStepResponse:
        return next(self.answers)

    def close(self) -> list[target_pb2.TargetStepResponse]:
        self.outbox.put(None)
        return list(self.answers)


def _prefill(rid: str, constraint: Constraint | None = None) -> target_pb2.TargetStepRequest:
    req = target_pb2.PrefillRequest(request_id=rid, input_ids=PROMPT_IDS)
    req.sampling.max_new_tokens = 8
    if constraint is not None:
        req.sampling.constraint.kind, req.sampling.constraint.text = (
            constraint.kind,
            constraint.text,
        )
    return target_pb2.TargetStepRequest(prefill=target_pb2.PrefillBatch(requests=[req]))


def _decode(rid: str, token: int) -> target_pb2.TargetStepRequest:
    batch = target_pb2.DecodeBatch(
        requests=[target_pb2.DecodeRequest(request_id=rid, token_id=token)]
    )
    return target_pb2.TargetStepRequest(decode=batch)


def _release(rid: str) -> target_pb2.TargetStepRequest:
    return target_pb2.TargetStepRequest(release=common_pb2.ReleaseBatch(request_ids=[rid]))


def _holds(demo) -> tuple[int, int]:
    o = occupancy(f"127.0.0.1:{demo.target.host.port}", "target")
    return o.num_requests, o.kv_slots_used


# -- past the engine's limits --------------------------------------------------------------------
def test_wide_schema_is_refused_at_the_router_naming_the_limit(demo, works) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": WIDE}}
    assert len(json.dumps(WIDE)) > 60_000
    with pytest.raises(openai.BadRequestError) as e:
        demo.http.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )
    message = e.value.response.json()["error"]["message"]
    assert "Current row has 9199 items; max is 2000" in message, message  # closed (strict)
    assert "json_schema" in message and "<state>" not in message, message
    params = SamplingParams(8, constraint=Constraint.json_schema(WIDE))
    with pytest.raises(grpc.RpcError) as e:
        list(demo.grpc.generate(prompt_token_ids=PROMPT_IDS, sampling=params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max is 2000" in e.value.details()
    assert "prefill" not in works  # refused before any work was sent to the target


def test_wide_schema_sent_to_the_target_holds_no_kv(demo, monkeypatch) -> None:
    extends, extend = [], prefill.extend_chunked
    monkeypatch.setattr(prefill, "extend_chunked", lambda *a: extends.append(a) or extend(*a))
    step = RawStep(demo.channel)
    step.send(_prefill("wide", Constraint.json_schema(WIDE)))
    (result,) = step.read().results
    assert result.status.code == INVALID and "max is 2000" in result.status.message
    assert _holds(demo) == (0, 0) and not extends  # asked while its stream is still open
    step.close()


# -- compiled off the step thread ---------------------------------------------------------------
def test_a_compiling_grammar_holds_neither_the_step_thread_nor_the_stream(demo, blocked) -> None:
    """Batch 1 (a constrained prefill) waits for its compile, which waits for the event; the
    batches behind it on the same stream (another request's prefill and two decode steps) are
    answered meanwhile; then the event is set and batch 1 is answered, its first token within
    the grammar's mask."""
    step = RawStep(demo.channel)
    held = step.send(_prefill("c", Constraint("regex", "held [0-9]+")))
    order = [step.send(_prefill("u"))]
    answer = step.read()
    for _ in range(2):
        assert answer.batch_id == order[-1] and answer.results[0].status.code == 0
        order.append(step.send(_decode("u", answer.results[0].token_ids[-1])))
        answer = step.read()
    assert answer.batch_id == order[-1] and not blocked.is_set()
    blocked.set()
    answer = step.read()
    assert answer.batch_id == held and answer.results[0].status.code == 0, answer
    step.send(_release("c"))
    step.send(_release("u"))
    assert len(step.close()) == 2


def test_a_release_behind_a_held_prefill_waits_for_it(demo, blocked) -> None:
    step = RawStep(demo.channel)
    held = step.send(_prefill("c2", Constraint("regex", "released [a-z]+")))
    release = step.send(_release("c2"))
    other = step.send(_prefill("u2"))
    assert step.read().batch_id == other  # answered while "c2" compiles
    assert _holds(demo)[0] == 1
    blocked.set()
    assert [step.read().batch_id for _ in range(2)] == [held, release]
    assert _holds(demo)[0] == 1  # "u2" alone: "c2" was created, then released
    step.send(_release("u2"))
    step.close()
    assert _holds(demo) == (0, 0)


def test_a_compile_past_the_bound_is_refused_naming_it(demo, blocked, monkeypatch) -> None:
    from specmesh.runtime import grammar
    from specmesh.target_service import server

    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.2, raising=False)
    monkeypatch.setattr(server, "COMPILE_TIMEOUT_S", 0.2, raising=False)
    step = RawStep(demo.channel)
    step.send(_prefill("slow", Constraint("regex", "bounded [0-9]+")))
    (result,) = step.read().results
    assert result.status.code == INVALID, result.status
    assert "did not compile within 0.2 s" in result.status.message
    assert _holds(demo) == (0, 0)
    step.close()


@pytest.mark.parametrize(("num_properties", "served"), [(450, True), (500, False)])
def test_the_first_masks_are_checked_where_the_engine_stops(demo, num_properties, served) -> None:
    """500 optional properties: 2,007 Earley items after ``{``, past the engine's 2,000."""
    from specmesh.protocol.constraints import compile_matcher

    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(num_properties)},
    }
    tokenizer = demo.target.runtime.grammars.tokenizer()
    if served:
        assert compile_matcher(Constraint.json_schema(schema), tokenizer) is not None
    else:
        with pytest.raises(InvalidRequestError, match="2007 items; max is 2000"):
            compile_matcher(Constraint.json_schema(schema), tokenizer)
