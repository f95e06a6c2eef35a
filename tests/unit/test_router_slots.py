"""The router's seams as state: whether an extend starts a request's draft state comes from its
slot (never a flag passed down), a slot forgets its placement whole, and a full KV cache means
"wait" only when other requests held it as the step was sent."""

from __future__ import annotations

import asyncio

import torch

from specmesh.protocol.errors import KVCacheFullError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.draft_rows import with_backlog
from specmesh.router.metrics import RouterMetrics
from specmesh.router.policy import SpeculationPolicy
from specmesh.router.replica import Preempted, TargetReplica
from specmesh.router.request import Request
from specmesh.router.slot import Slot


def _extend(ids: list[int], next_token: int) -> ExtendInput:
    return ExtendInput("r", ids, next_token, torch.full((len(ids), 2), float(ids[0])))


def test_held_extends_start_the_draft_state_until_one_was_sent() -> None:
    slot = Slot(Request("r", [1, 2], SamplingParams()))
    first = with_backlog(slot, _extend([1, 2], 3))
    assert first.new and first.committed_ids == [1, 2]
    slot.draft_backlog = [first]  # held: plain decoding planned
    joined = with_backlog(slot, _extend([3], 4))
    assert joined.new and joined.committed_ids == [1, 2, 3] and joined.next_token == 4
    assert joined.features.shape == (3, 2) and slot.draft_backlog == []
    slot.on_draft = True  # that extend was sent: the draft holds the request now
    assert not with_backlog(slot, _extend([4], 5)).new


def test_leaving_a_placement_forgets_its_draft_state() -> None:
    slot = Slot(Request("r", [1, 2], SamplingParams()))
    slot.prefill_sent, slot.prefilled, slot.on_draft = 2, True, True
    slot.tree, slot.draft_backlog = DraftTree.chain([3]), [_extend([3], 4)]
    assert slot.unplaced() is None
    assert (slot.prefill_sent, slot.prefilled, slot.on_draft, slot.tree) == (0, False, False, None)
    assert slot.draft_backlog == []  # a replay's first extend starts afresh, nothing stale joined
    assert with_backlog(slot, _extend([1, 2], 3)).committed_ids == [1, 2]


class _FullTarget:
    """Answers every verify with a full cache for request "a"."""

    name = "t"

    async def verify(self, inputs: list[VerifyInput], rows: bool = True) -> StepOutput:
        return StepOutput(errors={"a": KVCacheFullError("no free KV slots")})


def test_full_cache_waits_only_when_others_held_it_at_send_time() -> None:
    replica = TargetReplica(_FullTarget(), 1.0, SpeculationPolicy(), RouterMetrics(None))
    trees = [VerifyInput("a", DraftTree.chain([5]))]

    def error_with(load: int) -> Exception:
        replica.load = load
        return asyncio.run(replica.verify(trees)).errors["a"]

    assert isinstance(error_with(2), Preempted)  # another request held KV there: wait
    alone = error_with(1)  # it does not fit on its own: it fails
    assert isinstance(alone, KVCacheFullError) and not isinstance(alone, Preempted)
