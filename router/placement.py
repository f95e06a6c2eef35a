"""Where each request runs: its pinned target and draft replicas, and the replicas' load.

A request is pinned at admission to the least-loaded live target and, when it speculates, the
least-loaded draft whose circuit breaker is closed. The `Balancer` is the only code that changes
pins or load counts; the round and the core ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.protocol.errors import ServiceDownError
from specmesh.router.replica import DraftReplica, Replica, TargetReplica


@dataclass(eq=False)
class Placement:
    """A request's replicas. The request's state lives in both until it leaves them."""

    target: TargetReplica
    draft: DraftReplica | None = None

    def replicas(self) -> list[Replica]:
        return [self.target] if self.draft is None else [self.target, self.draft]


class Balancer:
    def __init__(self, targets: list[TargetReplica], drafts: list[DraftReplica]) -> None:
        self.targets, self.drafts = targets, drafts

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

    def place(self, speculate: bool) -> Placement:
        targets = self.live_targets()
        if not targets:
            raise ServiceDownError("no target replica is available")
        drafts = self.live_drafts() if speculate else []
        placement = Placement(min(targets, key=_load))
        placement.draft = min(drafts, key=_load) if drafts else None
        for replica in placement.replicas():
            replica.load += 1
        return placement

    def unpin_draft(self, placement: Placement) -> None:
        if placement.draft is not None:
            placement.draft.load -= 1
            placement.draft = None

    def unplace(self, placement: Placement) -> None:
        self.unpin_draft(placement)
        placement.target.load -= 1


def _load(replica: Replica) -> int:
    return replica.load
