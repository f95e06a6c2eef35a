"""A router started with ``--shared-memory`` (`specmesh.protocol.shared_rows`) over real gRPC
services on loopback: greedy output still equals transformers', the draft's feature rows came
through the target's ring and not through the router, the ring is unlinked with its stream,
and a reference to no region fails its batch alone."""

from __future__ import annotations

import grpc
import pytest
from grpc_harness import collect, count_batches, greedy, serve_router, wait_until

from specmesh.client import GenerationClient
from specmesh.protocol.shared_rows import SHM_DIR, RegionMaps, RowRing
from specmesh.runtime.codec import split_hidden_states
from specmesh.v1 import draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90]]


def shared(servicer, kind: type) -> list:
    """The shared-memory state of ``servicer``'s open streams, of ``kind``."""
    return [s.shared for s in servicer.owners.streams.values() if isinstance(s.shared, kind)]


def test_rows_go_through_shared_memory_and_leave_nothing_behind(copy_stack) -> None:
    stack = copy_stack
    router = stack.loop.run(
        serve_router(stack.target, stack.draft, settings={"shared_memory": True})
    )
    client = GenerationClient(f"127.0.0.1:{router.port}")
    drafted = count_batches(stack.draft)
    try:
        for prompt, n in zip(PROMPTS, [14, 9, 11, 20], strict=True):
            ids, _, last = collect(client.generate(prompt_token_ids=prompt, sampling=greedy(n)))
            assert ids == stack.expected(prompt, n)
            assert sum(last.stats.accept_lens) > last.stats.num_rounds  # drafts were accepted
        assert drafted["batches"] > 0
        (ring,) = shared(stack.target, RowRing)  # this router's stream, not the other's
        assert (SHM_DIR / ring.name).exists() and ring.end > 0  # rows were written there
        readers = shared(stack.draft, RegionMaps)
        assert any(ring.name in r.maps for r in readers)  # and the draft read them there
    finally:
        client.close()
        stack.loop.run(router.stop(0.5))
    assert wait_until(lambda: not (SHM_DIR / ring.name).exists())  # unlinked with its stream
    assert wait_until(lambda: not shared(stack.target, RowRing))


def test_a_reference_to_no_region_fails_its_batch_alone(copy_stack) -> None:
    import torch

    width = 3 * copy_stack.target.runtime.model_config.hidden_size
    ring = RowRing(1 << 20)
    states = split_hidden_states([2], {"aux_hidden": torch.randn(2, width)}, ring=ring)[0]
    ring.close()  # gone before the draft reads it
    extend = lambda rid, st: draft_pb2.DraftStepRequest(
        extend=draft_pb2.ExtendBatch(
            requests=[
                draft_pb2.ExtendRequest(
                    request_id=rid, token_ids=[5, 6], next_token_id=7, starts_request=True
                )
            ],
            states=st,
            propose_after=True,
        )
    )
    good = split_hidden_states([2], {"aux_hidden": torch.randn(2, width)})[0]
    batches = [extend("gone", states), extend("fine", good)]
    for i, b in enumerate(batches):
        b.batch_id = i + 1
    with grpc.insecure_channel(f"127.0.0.1:{copy_stack.draft.host.port}") as channel:
        out = list(draft_pb2_grpc.DraftStub(channel).Step(iter(batches), timeout=30))
    assert out[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "does not exist on this host" in out[0].status.message
    assert not out[1].status.code and out[1].results[0].tree.tokens[0] == 7
