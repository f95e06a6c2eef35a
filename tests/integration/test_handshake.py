"""The Step stream handshake: the router tells each target what its drafts read; a target
serves one set of EAGLE-3 aux layers at a time and refuses a stream that asks for another with
a status that says why; draft replicas that read different features are refused at start-up.
Aux layers are resolved in the handshake only, so a target of any depth serves drafts that read
none, and a handshake naming layers the model lacks is refused with INVALID_ARGUMENT (issue 26)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_harness import (
    LoopThread,
    collect,
    count_batches,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
)

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec, draft_needs
from specmesh.router.engine import Engine
from specmesh.rpc.wire import needs_to_pb
from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import generation_pb2, target_pb2, target_pb2_grpc


def _open(target, needs: FeatureSpec) -> list:
    """A Step stream from a router other than the one serving: its handshake's answers."""
    hello = target_pb2.TargetStepRequest(
        batch_id=1, open=target_pb2.StreamOpen(**needs_to_pb(needs))
    )
    with grpc.insecure_channel(f"127.0.0.1:{target.host.port}") as channel:
        return list(target_pb2_grpc.TargetStub(channel).Step(iter([hello]), timeout=30))


def test_target_refuses_other_aux_layers_while_a_router_reads_its_own(stack) -> None:
    served = stack.target.runtime.aux_layers  # what the stack's router stream asked for
    assert [
        o.status.code for o in _open(stack.target, FeatureSpec(Feature.AUX_HIDDEN, served))
    ] == [0]
    other = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers((0, 1), "input"))
    with pytest.raises(grpc.RpcError) as e:
        _open(stack.target, other)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "[0, 1]" in e.value.details() and "another router stream" in e.value.details()
    assert stack.target.runtime.aux_layers == served  # the live stream is undisturbed


def test_drafts_that_read_different_features_are_refused_with_the_reason() -> None:
    eagle3 = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers((1, 2, 3), "output"))
    assert draft_needs([eagle3, eagle3]) == eagle3 and draft_needs([]) == FeatureSpec()
    with pytest.raises(ValueError, match=r"aux_hidden of layers \[1, 2, 3\].*hidden_pre_norm"):
        draft_needs([eagle3, FeatureSpec(Feature.HIDDEN_PRE_NORM)])


# -- targets of any depth (issue 26) ------------------------------------------------------------
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture(scope="module")
def shallow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1- and 2-layer tiny targets (shallower than the default aux layers [2, L//2, L-3] reach)
    and an EAGLE-3 head for the 2-layer one that reads the outputs of both its layers."""
    root = tmp_path_factory.mktemp("shallow")
    make_tiny_target(root / "one", num_hidden_layers=1)
    make_tiny_target(root / "two", num_hidden_layers=2)
    make_tiny_eagle3(root / "eagle3", root / "two", aux_layer_ids=(0, 1))  # output numbering
    return root


@contextlib.contextmanager
def _served(target_dir: Path, draft_config: DraftConfig | None = None) -> Iterator:
    """Target (and draft) services and a router over them; yields (target, draft, client)."""
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(str(target_dir)))))
    draft = loop.run(serve_draft(load_draft(draft_config))) if draft_config else None
    router = None
    try:
        router = loop.run(serve_router(target, draft, settings={"connect_timeout_s": 10.0}))
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            yield target, draft, client
    finally:
        if router is not None:
            loop.run(router.stop(0.5))
        for servicer in (target, draft):
            if servicer is not None:
                loop.run(servicer.host.shutdown(0.5))
        loop.close()


def _captured(target) -> list[int]:
    """The aux layers GetInfo reports (layer inputs; empty when the target captures none)."""
    with grpc.insecure_channel(f"127.0.0.1:{target.host.port}") as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        return list(stub.GetInfo(generation_pb2.InfoRequest(), timeout=10).aux_layer_ids)


def _generate(client: GenerationClient, n: int) -> list[int]:
    return collect(client.generate(prompt_token_ids=PROMPT, sampling=greedy(n)))[0]


def test_one_layer_target_serves_without_a_draft(shallow: Path, oracle) -> None:
    with _served(shallow / "one") as (target, _, client):
        assert _generate(client, 8) == oracle(shallow / "one", PROMPT, 8)
        assert _captured(target) == []  # no draft reads aux states


def test_one_layer_target_serves_an_ngram_draft(shallow: Path, oracle) -> None:
    ngram = DraftConfig("ngram", None, str(shallow / "one"), SpecParams(3, 2, 5))
    with _served(shallow / "one", ngram) as (target, draft, client):
        drafted = count_batches(draft)
        assert _generate(client, 12) == oracle(shallow / "one", PROMPT, 12)
        assert _captured(target) == []
    assert drafted["batches"] > 0 and not any(drafted["codes"])


def test_two_layer_target_captures_the_eagle3_heads_layers(shallow: Path, oracle) -> None:
    head = DraftConfig("eagle3", str(shallow / "eagle3"), str(shallow / "two"), SpecParams(2, 2, 4))
    with _served(shallow / "two", head) as (target, draft, client):
        drafted = count_batches(draft)  # its extends carry the target's [T, 2H] aux rows
        assert _generate(client, 8) == oracle(shallow / "two", PROMPT, 8)
        assert _captured(target) == [1, 2]  # outputs of layers 0, 1 = inputs of layers 1, 2
    assert drafted["batches"] > 0 and not any(drafted["codes"])


def test_aux_layers_that_do_not_fit_are_refused_and_the_target_serves_on(
    shallow: Path, oracle
) -> None:
    with _served(shallow / "one") as (target, _, client):
        # The draft's own ids, and no ids: the default [2, L//2, L-3] is [2, 0, -2] at L = 1.
        for ids, named in (((0, 3), "[0, 3]"), (None, "[2, 0, -2]")):
            needs = FeatureSpec(Feature.AUX_HIDDEN, ids and AuxLayers(ids, "input"))
            with pytest.raises(grpc.RpcError) as e:
                _open(target, needs)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in e.value.details() and "1-layer model" in e.value.details()
        assert _generate(client, 8) == oracle(shallow / "one", PROMPT, 8)  # the router's stream
        assert [o.status.code for o in _open(target, FeatureSpec())] == [0]  # and new streams
        assert _captured(target) == []


def test_configured_aux_layers_are_checked_against_the_depth(shallow: Path) -> None:
    with pytest.raises(ValueError, match=r"aux layer ids \[0, 3\] .*a 2-layer model"):
        TargetRuntime(TargetConfig(str(shallow / "two"), aux_layer_ids=(0, 3)))
    cfg = TargetConfig(str(shallow / "two"), aux_layer_ids=(0, 1), aux_convention="output")
    assert TargetRuntime(cfg).aux_points == (1, 2)


def test_in_process_engine_serves_a_one_layer_target(shallow: Path, oracle) -> None:
    expected = oracle(shallow / "one", PROMPT, 10)
    for kind in (None, "ngram"):
        engine = Engine(shallow / "one", draft_kind=kind, spec=SpecParams(3, 2, 5))
        (result,) = engine.generate([PROMPT], greedy(10))
        assert result.token_ids == expected, kind
        assert engine.target.aux_layers is None  # no draft read aux states: none resolved
