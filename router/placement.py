"""Where each request runs: its pinned target and draft replicas, and the replicas' load.

A request is pinned at admission to the least-loaded live target and, when it speculates, the
least-loaded draft whose circuit breaker is closed. The `Balancer` is the only code that changes
pins or load counts; the round and the core ask it.

Capacity. A replica holds at most the requests its service advertises (``--max-requests``:
request rows, and so its largest batch; `Replica.has_room`). A request's load counts from its
placement until its release was sent, and a release travels in-band ahead of any later step, so
a replica is never sent more requests than it holds. A request with no live replica that has
room is not placed (`place` answers None): it waits for admission, never fails for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specmesh.protocol.errors import ServiceDownError
from specmesh.router.prefix_index import PrefixIndex, prompt_keys
from specmesh.router.replica import DraftReplica, Replica, TargetReplica


@dataclass(eq=False)
class Placement:
    """A request's replicas. The request's state lives in both until it leaves them."""

    target: TargetReplica
    draft: DraftReplica | None = None

    def replicas(self) -> list[Replica]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    async def release(self, rid: str) -> list[Exception]:
        """Release the request in every replica, each whatever the others answer; returns
        the failures (a release that fails must not keep the request from ending)."""
        answers = await asyncio.gather(
            *(r.release([rid]) for r in self.replicas()), return_exceptions=True
        )
        return [a for a in answers if isinstance(a, Exception)]


PLACEMENTS = ("cache-aware", "least-loaded")
SLACK = 4  # cache-aware: requests a replica may run beyond the least loaded one's


class Balancer:
    def __init__(
        self,
        targets: list[TargetReplica],
        drafts: list[DraftReplica],
        placement: str = "cache-aware",
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r}: choose from {', '.join(PLACEMENTS)}")
        self.targets, self.drafts = targets, drafts
        self.indexes = {t: PrefixIndex() for t in targets} if placement == "cache-aware" else {}

    @property
    def all(self) -> list[Replica]:
        return [*self.targets, *self.drafts]

    def live_targets(self) -> list[TargetReplica]:
        return [t for t in self.targets if t.live]

    def live_drafts(self) -> list[DraftReplica]:
        return [d for d in self.drafts if d.live]

    def any_draft_healthy(self) -> bool:
        """A draft has served a step since its last failure (its breaker is fully closed)."""
        return any(d.breaker.failures == 0 for d in self.drafts)

    def place(self, speculate: bool, prompt_ids: list[int] | None = None) -> Placement | None:
        """Pin a request to live replicas with room (the target by `_pick_target`, the least
        loaded draft); None when every live target (or, for a request that speculates, every
        live draft) is full: it waits. A request is placed without a draft only when no draft
        is live."""
        targets = self.live_targets()
        if not targets:
            raise ServiceDownError("no target replica is available")
        drafts = self.live_drafts() if speculate else []
        targets, roomy_drafts = _with_room(targets), _with_room(drafts)
        if not targets or (drafts and not roomy_drafts):
            return None
        placement = Placement(self._pick_target(targets, prompt_ids or []))
        placement.draft = min(roomy_drafts, key=_load) if roomy_drafts else None
        for replica in placement.replicas():
            replica.load += 1
        return placement

    def _pick_target(self, targets: list[TargetReplica], prompt_ids: list[int]) -> TargetReplica:
        """The least loaded; cache-aware (`router.prefix_index`): the longest remembered prefix
        among those within ``SLACK`` of the least loaded, else the one remembering the fewest
        blocks (new prefixes spread evenly), else the less loaded."""
        least = min(targets, key=_load)
        if not self.indexes or not prompt_ids:
            return least
        keys = prompt_keys(prompt_ids)
        near = [t for t in targets if t.load <= least.load + SLACK]
        index = self.indexes
        best = max(near, key=lambda t: (index[t].match(keys), -len(index[t].blocks), -t.load))
        self.indexes[best].add(keys)
        return best

    def unpin_draft(self, placement: Placement) -> None:
        if placement.draft is not None:
            placement.draft.load -= 1
            placement.draft = None

    def unplace(self, placement: Placement) -> None:
        self.unpin_draft(placement)
        placement.target.load -= 1


def _load(replica: Replica) -> int:
    return replica.load


def _with_room(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.has_room]
