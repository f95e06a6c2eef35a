"""The draft's Step stream and grammars, raw (`draft.proto`): a bad constraint fails only its
request; a starting extend whose grammar still compiles is held off the step thread while the
batches behind it are drafted; a PrepareBatch starts compiles ahead of the extends (answered once
compiled, even after its client stopped sending; refused past the batch limit, compiling
nothing); and the draft holds nothing afterwards. The demo draft (fp32) served alone."""

from __future__ import annotations

import json
import queue
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_harness import LoopThread, block_compiles, serve_draft, wait_until

from specmesh.defaults import REPO_MODELS
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.constraints import Constraint
from specmesh.runtime.codec import split_hidden_states
from specmesh.v1 import draft_pb2, draft_pb2_grpc, generation_pb2

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "line": {"type": "integer"}},
    "required": ["name", "line"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def draft():
    """The demo EAGLE-3 draft service on loopback."""
    target_dir, draft_dir = str(REPO_MODELS / "target"), str(REPO_MODELS / "draft")
    loop = LoopThread()
    spec = SpecParams(num_steps=4, topk=4, num_draft_tokens=8)
    cfg = DraftConfig("eagle3", draft_dir, target_dir, spec, dtype="float32")
    servicer = loop.run(serve_draft(load_draft(cfg)))
    yield SimpleNamespace(address=f"127.0.0.1:{servicer.host.port}", runtime=servicer.runtime)
    loop.run(servicer.host.shutdown(0.5))
    loop.close()


def test_a_bad_constraint_fails_only_its_request_on_the_draft(draft) -> None:
    """On the draft's Step stream: an unknown kind, a schema that does not compile and a
    constraint on a later extend are INVALID_ARGUMENT each; the batch's other request is served,
    and the draft holds nothing once the stream ends."""
    width, c = 3 * 256, generation_pb2.Constraint
    good = c(kind="json_schema", text=json.dumps(SCHEMA))
    reqs = {
        "kind": c(kind="ebnf", text="x"),
        "objectx": c(kind="json_schema", text='{"type": "objectx"}'),
        "ok": good,
    }
    extends = [draft_pb2.ExtendRequest(request_id=rid, token_ids=[5, 6, 7], next_token_id=93,
                                       starts_request=True, constraint=con, output_start=3)
               for rid, con in reqs.items()]  # fmt: skip
    later = draft_pb2.ExtendRequest(request_id="ok", token_ids=[93], next_token_id=5,
                                    constraint=good)  # fmt: skip
    batches = [
        _draft_step(1, extends, torch.randn(9, width)),
        _draft_step(2, [later], torch.randn(1, width)),
    ]
    with grpc.insecure_channel(draft.address) as channel:
        out = list(draft_pb2_grpc.DraftStub(channel).Step(iter(batches), timeout=30))
    first = {r.request_id: r for r in out[0].results}
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert first["ok"].status.code == 0 and first["ok"].tree.tokens[0] == 93
    for rid in ("kind", "objectx"):
        assert first[rid].status.code == invalid and rid in first[rid].status.message
    assert out[1].results[0].status.code == invalid, out[1].results[0].status
    assert "starting extend" in out[1].results[0].status.message
    assert wait_until(lambda: not draft.runtime.grammars.tracks and not draft.runtime.live)


def test_a_compiling_grammar_holds_its_draft_batch_not_the_step_thread(draft, monkeypatch) -> None:
    """A starting extend whose constraint still compiles is held back on the draft, and an
    extend of another request sent behind it on the same stream is drafted and answered
    meanwhile; then the held one is answered. The compile waits for an event set only once the
    other answer arrived: the order of the answers, not a clock, shows nothing waited for it."""
    go = block_compiles(draft.runtime.grammars.grammars, monkeypatch)
    schema = {"type": "object", "properties": {"held": {"type": "integer"}}}
    constraint = generation_pb2.Constraint(kind="json_schema", text=json.dumps(schema))
    start = lambda rid, **kw: draft_pb2.ExtendRequest(
        request_id=rid, token_ids=[5, 6, 7], next_token_id=93, starts_request=True, **kw
    )
    outbox: queue.Queue = queue.Queue()
    with grpc.insecure_channel(draft.address) as channel:
        answers = draft_pb2_grpc.DraftStub(channel).Step(iter(outbox.get, None), timeout=30)
        outbox.put(_draft_step(1, [start("held", constraint=constraint, output_start=3)],
                               torch.randn(3, 3 * 256)))  # fmt: skip
        outbox.put(_draft_step(2, [start("free")], torch.randn(3, 3 * 256)))
        first = next(answers)
        assert first.batch_id == 2 and not go.is_set()
        assert first.results[0].status.code == 0 and len(first.results[0].tree.tokens) > 1
        go.set()
        second = next(answers)
        assert second.batch_id == 1 and second.results[0].status.code == 0, second
        assert second.results[0].tree.tokens[0] == 93
        outbox.put(None)
        assert list(answers) == []
    assert wait_until(lambda: not draft.runtime.grammars.tracks and not draft.runtime.live)


def test_a_prepare_is_answered_and_one_past_the_batch_limit_refused(draft) -> None:
    """On the draft's Step stream: a PrepareBatch is answered once its grammar compiled (it
    holds no request); one naming more constraints than a batch has requests is
    INVALID_ARGUMENT, having compiled nothing."""
    c, limit = generation_pb2.Constraint, draft.runtime.cfg.max_requests
    ok = c(kind="regex", text="prepared [0-9]+")
    many = [c(kind="regex", text=f"too many {i}") for i in range(limit + 1)]
    outbox: queue.Queue = queue.Queue()
    outbox.put(
        draft_pb2.DraftStepRequest(batch_id=1, prepare=draft_pb2.PrepareBatch(constraints=[ok]))
    )
    outbox.put(
        draft_pb2.DraftStepRequest(batch_id=2, prepare=draft_pb2.PrepareBatch(constraints=many))
    )
    with grpc.insecure_channel(draft.address) as channel:
        stream = draft_pb2_grpc.DraftStub(channel).Step(iter(outbox.get, None), timeout=30)
        answers = {a.batch_id: a for a in (next(stream), next(stream))}  # held ones included
        outbox.put(None)
    assert answers[1].status.code == 0 and not answers[1].results
    assert answers[2].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"at most {limit}" in answers[2].status.message
    compiled = draft.runtime.grammars.grammars._compiled
    assert Constraint("regex", ok.text) in compiled
    assert not any(Constraint("regex", m.text) in compiled for m in many)
    assert wait_until(lambda: not draft.runtime.live)


def test_a_held_prepare_is_answered_after_its_client_stopped_sending(draft, monkeypatch) -> None:
    """The client half-closes its Step stream while a prepare (a held batch naming no request)
    still compiles: the answer still comes before the stream ends."""
    go = block_compiles(draft.runtime.grammars.grammars, monkeypatch)
    prepare = draft_pb2.PrepareBatch(
        constraints=[generation_pb2.Constraint(kind="regex", text="late")]
    )
    threading.Timer(0.3, go.set).start()  # after the stream's requests ended
    with grpc.insecure_channel(draft.address) as channel:
        batch = draft_pb2.DraftStepRequest(batch_id=7, prepare=prepare)
        out = list(draft_pb2_grpc.DraftStub(channel).Step(iter([batch]), timeout=30))
    assert [(a.batch_id, a.status.code) for a in out] == [(7, 0)]


def _draft_step(batch_id: int, requests: list, feats: torch.Tensor) -> draft_pb2.DraftStepRequest:
    states = split_hidden_states([len(r.token_ids) for r in requests], {"aux_hidden": feats})[0]
    batch = draft_pb2.ExtendBatch(requests=requests, states=states, propose_after=True)
    return draft_pb2.DraftStepRequest(batch_id=batch_id, extend=batch)
