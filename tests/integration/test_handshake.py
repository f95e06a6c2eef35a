"""The Step stream handshake: the router tells each target what its drafts read; a target
serves one set of EAGLE-3 aux layers at a time and refuses a stream that asks for another with
a status that says why; draft replicas that read different features are refused at start-up."""

from __future__ import annotations

import grpc
import pytest

from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
from specmesh.router.core import draft_needs
from specmesh.rpc.wire import needs_to_pb
from specmesh.v1 import target_pb2, target_pb2_grpc


def _open(stack, needs: FeatureSpec) -> list:
    hello = target_pb2.TargetStepRequest(
        batch_id=1, open=target_pb2.StreamOpen(**needs_to_pb(needs))
    )
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.host.port}") as channel:
        return list(target_pb2_grpc.TargetStub(channel).Step(iter([hello]), timeout=30))


def test_target_refuses_other_aux_layers_while_a_router_reads_its_own(stack) -> None:
    served = stack.target.runtime.aux_layers  # what the stack's router stream asked for
    assert [o.status.code for o in _open(stack, FeatureSpec(Feature.AUX_HIDDEN, served))] == [0]
    other = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers((0, 1), "input"))
    with pytest.raises(grpc.RpcError) as e:
        _open(stack, other)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "[0, 1]" in e.value.details() and "another router stream" in e.value.details()
    assert stack.target.runtime.aux_layers == served  # the live stream is undisturbed


def test_drafts_that_read_different_features_are_refused_with_the_reason() -> None:
    eagle3 = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers((1, 2, 3), "output"))
    assert draft_needs([eagle3, eagle3]) == eagle3 and draft_needs([]) == FeatureSpec()
    with pytest.raises(ValueError, match=r"aux_hidden of layers \[1, 2, 3\].*hidden_pre_norm"):
        draft_needs([eagle3, FeatureSpec(Feature.HIDDEN_PRE_NORM)])
