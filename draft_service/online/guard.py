"""The guard: an update is served only if it does not lower simulated acceptance on held-out
traffic.

Three weight sets are scored on the same held-out requests (`TrafficBuffer.heldout`), by the
draft tokens their chains would have had accepted (`head.chain_accepted`, with the tree's top-k):
the candidate (the trainer's weights after an update), the served weights, and the shipped ones
(`--model`). With floor = (1 - threshold) x shipped:

    keep    candidate >= served and candidate >= floor: the candidate is served
    refuse  otherwise the served weights stay (the update is rolled back from serving), and
      rewind  candidate < floor: the trainer, too, goes back to the served weights
      reset   served < floor (newer traffic): the shipped weights are served again
            else the trainer goes on from its candidate (fine-tuning first costs a little
            acceptance, then recovers it: a trainer sent back after every dip never learns)

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
    keep: bool  # the candidate is served
    rewind: bool  # not kept, and the trainer goes back to the served weights
    reset: bool  # not kept, and the shipped weights are served again (the trainer with them)


class Guard:
    def __init__(self, threshold: float, depth: int, embed: Embed, topk: int = 1) -> None:
        self.threshold, self.depth, self.embed, self.topk = threshold, depth, embed, topk

    def score(self, head: TrainableHead, heldout: list[tuple[torch.Tensor, torch.Tensor]]) -> Score:
        device = head.fc.weight.device
        accepted = rounds = 0
        for i in range(0, len(heldout), EVAL_WINDOWS):
            batch = make_batch(heldout[i : i + EVAL_WINDOWS], self.depth, device)
            a, r = chain_accepted(head, batch, self.embed, self.depth, self.topk)
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
        rewind = not keep and after.accepted < floor
        reset = not keep and before.accepted < floor
        return Verdict(after, before, base, keep, rewind, reset)
