"""Where each request runs: its pinned target and draft replicas, and the replicas' load.

A request is pinned at admission to the least-loaded live target and, when it speculates, the
least-loaded draft whose circuit breaker is closed. The `Balancer` is the only code that changes
pins or load counts; the round and the core ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.protocol.errors import ServiceDownError
from specmesh.router.clients import DraftClient, TargetClient
from specmesh.router.faults import CircuitBreaker


@dataclass(eq=False)
class Placement:
    """A request's replicas. The request's state lives in both until it leaves them."""

    target: TargetClient
    draft: DraftClient | None = None


class Balancer:
    def __init__(
        self,
        targets: list[TargetClient],
        drafts: list[DraftClient],
        target_cooldown_s: float,
        draft_cooldown_s: float,
    ) -> None:
        self.targets, self.drafts = targets, drafts
        self.breakers = {
            **{t.name: CircuitBreaker(target_cooldown_s) for t in targets},
            **{d.name: CircuitBreaker(draft_cooldown_s) for d in drafts},
        }
        self.load: dict[str, int] = {c.name: 0 for c in [*targets, *drafts]}

    def live_targets(self) -> list[TargetClient]:
        return [t for t in self.targets if self.breakers[t.name].allows()]

    def live_drafts(self) -> list[DraftClient]:
        return [d for d in self.drafts if self.breakers[d.name].allows()]

    def any_draft_healthy(self) -> bool:
        """A draft has served a step since its last failure (its breaker is fully closed)."""
        return any(self.breakers[d.name].failures == 0 for d in self.drafts)

    def place(self, speculate: bool) -> Placement:
        targets = self.live_targets()
        if not targets:
            raise ServiceDownError("no target replica is available")
        drafts = self.live_drafts() if speculate else []
        placement = Placement(min(targets, key=self._load_of))
        placement.draft = min(drafts, key=self._load_of) if drafts else None
        for client in (placement.target, placement.draft):
            if client is not None:
                self.load[client.name] += 1
        return placement

    def unpin_draft(self, placement: Placement) -> None:
        if placement.draft is not None:
            self.load[placement.draft.name] -= 1
            placement.draft = None

    def unplace(self, placement: Placement) -> None:
        self.unpin_draft(placement)
        self.load[placement.target.name] -= 1

    def num_placed(self, target: TargetClient) -> int:
        """Requests pinned to ``target``: every request that may hold KV there."""
        return self.load[target.name]

    def _load_of(self, client: TargetClient | DraftClient) -> int:
        return self.load[client.name]
