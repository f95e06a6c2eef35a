"""A draft runtime that pre-drafts (``specmesh draft --predraft N``,
`specmesh.draft_service.predraft`): on for the drafters whose steps share one network (not MTP:
a step's layer is its depth). Without it the runtime is `DraftRuntime`, whose step never looks
for pre-drafts.

A request whose extend matches an outcome drafted ahead gets that tree; when every request of
the batch does, the answer goes out before the extend, which `after_step` then runs (with the
next pre-draft) while the target verifies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from specmesh.draft_service.drafter import TreeDrafter
from specmesh.draft_service.grammar import BatchGrammar
from specmesh.draft_service.predraft import Outcome, PreDrafter
from specmesh.draft_service.predraft_budget import PredraftBudget
from specmesh.draft_service.runtime import DraftRuntime
from specmesh.protocol.config import DraftConfig
from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.steps import DraftStepResult, ExtendInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class _AfterStep:
    extends: list[ExtendInput]  # answered from pre-drafts, not run yet
    hits: dict[str, Outcome]  # their outcomes
    rids: list[str]  # the requests to pre-draft for next


class PredraftRuntime(DraftRuntime):
    def __init__(self, cfg: DraftConfig, drafter: TreeDrafter, target: ModelConfig) -> None:
        super().__init__(cfg, drafter, target)
        self.ahead = PreDrafter(drafter, cfg.predraft, cfg.predraft_steps)
        self.pending: _AfterStep | None = None  # the work `after_step` does once answered
        self.budget = PredraftBudget()  # whether a pre-draft pays, per batch size

    def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        """`DraftRuntime.step`, answering from pre-drafted trees where an extend matches."""
        started = time.perf_counter()
        result = DraftStepResult()
        ok = self._admit_all(extends, result.errors)
        hits = {e.rid: o for e in ok if (o := self.ahead.take(e)) is not None}
        if propose and ok and len(hits) == len(ok):
            self._answer_hits(hits, result)
            self.budget.observe(len(ok), True, time.perf_counter() - started)
            self._after(ok, hits, [e.rid for e in ok])
            return result
        ok = self._extend(ok, result.errors)
        hits = {e.rid: hits[e.rid] for e in ok if e.rid in hits}
        for rid, outcome in hits.items():
            self.ahead.adopt(rid, outcome)
        if propose:
            self._answer_hits(hits, result)
            self._propose([e for e in ok if e.rid not in hits], result)
            self.budget.observe(len(ok), False, time.perf_counter() - started)
            self._after([], {}, [e.rid for e in ok if e.rid in self.live])
        return result

    def _after(self, extends: list[ExtendInput], hits: dict, rids: list[str]) -> None:
        """Leave for `after_step` the extends answered ahead and, when the budget says it
        pays, the next pre-draft."""
        if not self.budget.allows(len(rids)):
            rids = []
        self.pending = _AfterStep(extends, hits, rids) if extends or rids else None

    def _answer_hits(self, hits: dict, result: DraftStepResult) -> None:
        result.trees.update({rid: o.tree for rid, o in hits.items()})
        result.predrafted.update(hits)
        if self.learner is not None:
            result.versions.update({rid: o.version for rid, o in hits.items()})

    def after_step(self) -> None:
        """What the last step left for after its answer: the extends of a batch answered from
        pre-drafts, then the next pre-draft. A failure here fails no request's answer already
        sent: an extend that fails drops the request (its next step finds it gone); a pre-draft
        that fails only leaves nothing drafted."""
        work, self.pending = self.pending, None
        if work is None:
            return
        errors: dict[str, SpecmeshError] = {}
        for inp in self._extend(work.extends, errors):
            self.ahead.adopt(inp.rid, work.hits[inp.rid])
        if not work.rids:
            return
        if self.learner is not None:  # the extends above swapped in any version published
            self.ahead.version = self.learner.info.version
        try:
            self.ahead.predraft(
                [r for r in work.rids if r in self.live and not self.grammars.holds(r)]
            )
        except Exception:
            log.exception("pre-draft failed for %s", work.rids)
        self.budget.pre_drafted()

    def _trees(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None
    ) -> list[DraftTree]:
        propose = self.ahead.propose
        return propose(rids, roots) if grammar is None else propose(rids, roots, grammar)

    def _forget(self, rid: str) -> None:
        super()._forget(rid)
        self.ahead.release(rid)
