"""The guard: an update is served only if it does not lower simulated acceptance on held-out
traffic.

Three weight sets are scored on the same held-out requests (`TrafficBuffer.heldout`), by the
draft tokens their greedy chains would have had accepted (`head.chain_accepted`): the
candidate (the update just trained), the served weights, and the shipped ones (`--model`).

    keep    candidate >= served            the update does not lower acceptance
            candidate >= (1 - threshold) x shipped
    reset   not keep, and served < (1 - threshold) x shipped: the shipped weights come back

Counting accepted tokens, not tokens per round, keeps the rule blind to rows no weights predict
(random tokens): they add nothing to any count, so a stream of them cannot dilute a loss on
the real traffic beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.draft_service.online.buffer import Window
from specmesh.draft_service.online.head import (
    Embed,
    TrainableHead,
    chain_accepted,
    load_into,
    make_batch,
)

EVAL_WINDOWS = 8  # held-out requests per forward


@dataclass(frozen=True)
class Score:
    accepted: int  # draft tokens the chains would have had accepted
    rounds: int  # round starts simulated

    @property
    def accept_length(self) -> float:
        """Tokens per target forward: 1 (the bonus) + accepted drafts per round."""
        return 1.0 + self.accepted / max(self.rounds, 1)


@dataclass(frozen=True)
class Verdict:
    candidate: Score
    served: Score
    shipped: Score
    keep: bool
    reset: bool  # served back to the shipped weights


class Guard:
    def __init__(self, threshold: float, depth: int, embed: Embed) -> None:
        self.threshold, self.depth, self.embed = threshold, depth, embed

    def score(self, head: TrainableHead, heldout: list[tuple[torch.Tensor, torch.Tensor]]) -> Score:
        device = head.fc.weight.device
        accepted = rounds = 0
        for i in range(0, len(heldout), EVAL_WINDOWS):
            batch = make_batch(heldout[i : i + EVAL_WINDOWS], self.depth, device)
            a, r = chain_accepted(head, batch, self.embed, self.depth)
            accepted, rounds = accepted + a, rounds + r
        return Score(accepted, rounds)

    def judge(
        self,
        candidate: TrainableHead,
        scratch: TrainableHead,
        served: dict[str, torch.Tensor],
        shipped: dict[str, torch.Tensor],
        heldout: list[Window],
    ) -> Verdict:
        """Score the three weight sets (``served`` and ``shipped`` loaded into ``scratch``)."""
        after = self.score(candidate, heldout)
        load_into(scratch, served)
        before = self.score(scratch, heldout)
        load_into(scratch, shipped)
        base = self.score(scratch, heldout)
        floor = (1.0 - self.threshold) * base.accepted
        keep = after.accepted >= before.accepted and after.accepted >= floor
        reset = not keep and before.accepted < floor
        return Verdict(after, before, base, keep, reset)
