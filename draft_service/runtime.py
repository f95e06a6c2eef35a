"""The draft service's runtime: one drafter of a configured kind, and the registry of the
requests it holds.

Draft kinds (``--draft-kind``): ``eagle3`` (SpecForge / SGLang EAGLE-3), ``eagle`` (EAGLE-1/2),
``mtp`` (multi-layer EAGLE: one layer and one KV pool per step), ``standalone`` (a small causal LM
with the target's tokenizer) and ``ngram`` (prompt lookup, no model).

Lifecycle of a request here: created by its starting extend, advanced by later extends, freed
by `release` or by any step that fails it; a constrained request's grammar matcher with it
(`specmesh.draft_service.grammar`). A failure is per request: the rows of a batch are
checked before any state changes, and a batch whose forward raises is retried row by row, so a
bad row fails alone and leaves nothing allocated.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from specmesh.draft_service.drafter import TreeDrafter
from specmesh.draft_service.grammar import BatchGrammar, DraftGrammars
from specmesh.draft_service.predraft import Outcome, PreDrafter
from specmesh.draft_service.predraft_budget import PredraftBudget
from specmesh.protocol.config import DRAFT_KINDS, DraftConfig, SpecParams
from specmesh.protocol.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    SpecmeshError,
    UnknownRequestError,
    as_specmesh_error,
)
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.steps import DraftInfo, DraftStepResult, ExtendInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.config import ModelConfig, resolve_max_context
from specmesh.runtime.grammar import Grammars
from specmesh.runtime.graph_runner import graphs_enabled
from specmesh.runtime.tree import Tree

log = logging.getLogger(__name__)


class Drafter(Protocol):
    needs: FeatureSpec
    spec: SpecParams

    def extend(self, inputs: list[ExtendInput]) -> None:
        """Validate every input, then forward them as one batch (state changes only after)."""

    def propose(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None = None
    ) -> list[Tree]:
        """A tree per request; ``grammar``'s constrained requests' hold only allowed tokens."""

    def release(self, rid: str) -> None: ...
    def check_context(self, rid: str, num_new_tokens: int) -> None:
        """Raise unless the request fits its extend and one tree (before any forward)."""


class DraftRuntime:
    def __init__(self, cfg: DraftConfig, drafter: Drafter, target: ModelConfig) -> None:
        self.cfg, self.drafter, self.target = cfg, drafter, target
        self.live: dict[str, int] = {}  # the requests held -> pending token (next tree's root)
        # Pre-drafting (`specmesh.draft_service.predraft`): on with --predraft N for the drafters
        # whose steps share one network (not MTP: a step's layer is its depth).
        self.ahead = (
            PreDrafter(drafter, cfg.predraft, cfg.predraft_steps)
            if cfg.predraft and isinstance(drafter, TreeDrafter) and drafter.supports_predraft
            else None
        )
        self.pending: _AfterStep | None = None  # the work `after_step` does once answered
        self.budget = PredraftBudget()  # whether a pre-draft pays, per batch size
        # Constrained requests' matchers, compiled with the target's tokenizer (never pre-drafted)
        self.grammars = DraftGrammars(
            Grammars(cfg.target_dir, target.vocab_size, target.eos_token_ids)
        )

    def info(self) -> DraftInfo:
        s = self.cfg.spec
        return DraftInfo(self.cfg.kind, self.drafter.needs, s.num_steps, s.topk,
                         s.num_draft_tokens, self.cfg.max_requests)  # fmt: skip

    def holds(self, rid: str) -> bool:
        return rid in self.live

    def kv_slots(self) -> tuple[int, int]:
        """(used, free) KV slots; (0, 0) for a drafter without a KV cache (n-gram). Prefix
        cache slots no request lists count as free."""
        cache = getattr(self.drafter, "cache", None)
        if cache is None:
            return (0, 0)
        prefixes = getattr(self.drafter, "prefixes", None)
        spare = 0 if prefixes is None else prefixes.num_evictable_slots
        return cache.num_used_slots - spare, cache.num_free_slots + spare

    # -- step ----------------------------------------------------------------------------------
    def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        """Extend every request over its newly committed tokens, then (optionally) propose the
        next tree for each. A request that fails is dropped; the others are served.

        With pre-drafting, a request whose extend matches an outcome drafted ahead gets that
        tree; when every request of the batch does, the answer goes out before the extend,
        which `after_step` then runs (with the next pre-draft) while the target verifies."""
        started = time.perf_counter()
        result = DraftStepResult()
        ok = [e for e in extends if self._admit(e, result.errors)]
        hits = {e.rid: o for e in ok if self.ahead and (o := self.ahead.take(e)) is not None}
        for inp in ok:
            self.live[inp.rid] = inp.next_token
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
            if self.ahead is not None:
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
        result.trees.update({rid: _wire(o.tree) for rid, o in hits.items()})
        result.predrafted.update(hits)

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
        try:
            self.ahead.predraft(
                [r for r in work.rids if r in self.live and not self.grammars.holds(r)]
            )
        except Exception:
            log.exception("pre-draft failed for %s", work.rids)
        self.budget.pre_drafted()

    def propose(self, roots: list[ExtendInput]) -> DraftStepResult:
        """Trees for requests already extended; ``roots[i].next_token`` must be the request's
        pending token."""
        result = DraftStepResult()
        ok = []
        for inp in roots:
            pending = self.live.get(inp.rid)
            if pending is None:
                result.errors[inp.rid] = UnknownRequestError(f"unknown request id {inp.rid!r}")
            elif inp.next_token != pending:
                result.errors[inp.rid] = InvalidRequestError(
                    f"request {inp.rid!r}: root {inp.next_token} is not the pending token {pending}"
                )
            else:
                ok.append(inp)
        self._propose(ok, result)
        return result

    def _propose(self, ok: list[ExtendInput], result: DraftStepResult) -> None:
        if not ok:
            return
        propose = self.ahead.propose if self.ahead is not None else self.drafter.propose
        rids, roots = [i.rid for i in ok], [i.next_token for i in ok]
        grammar = self.grammars.batch(rids)  # None unless one of them is constrained
        try:
            trees = propose(rids, roots) if grammar is None else propose(rids, roots, grammar)
            result.trees.update({i.rid: _wire(t) for i, t in zip(ok, trees, strict=True)})
        except Exception as e:
            self._fail(ok, e, result.errors)

    def _admit(self, inp: ExtendInput, errors: dict[str, SpecmeshError]) -> bool:
        """Checks that need no forward, then the request's grammar (if any) takes the ids; a
        continuing request that fails them is dropped."""
        try:
            if inp.new and inp.rid in self.live:
                raise DuplicateRequestError(f"request {inp.rid!r} already has draft state")
            if not inp.new and inp.rid not in self.live:
                raise UnknownRequestError(f"unknown request id {inp.rid!r}")
            ids = [*inp.committed_ids, inp.next_token]
            vocab = self.target.vocab_size
            if not inp.committed_ids or not all(0 <= t < vocab for t in ids):
                raise InvalidRequestError(
                    f"request {inp.rid!r}: extend ids must be non-empty and in [0, {vocab}); "
                    f"got {len(inp.committed_ids)} ids, max {max(ids)}"
                )
            self.drafter.check_context(inp.rid, len(inp.committed_ids))
            self.grammars.advance(inp)
        except SpecmeshError as e:
            errors[inp.rid] = e
            if not isinstance(e, DuplicateRequestError):
                self.release(inp.rid)
            return False
        return True

    def _extend(self, inputs: list[ExtendInput], errors: dict) -> list[ExtendInput]:
        if not inputs:
            return []
        try:
            self.drafter.extend(inputs)  # the batched fast path
            return inputs
        except Exception:
            # Drafters check every row before any forward, and commit only after it: a failed
            # batch changed nothing but the rows it added for new requests. Drop those, then
            # isolate the bad rows one by one.
            for inp in inputs:
                if inp.new:
                    with contextlib.suppress(KeyError):
                        self.drafter.release(inp.rid)
        good = []
        for inp in inputs:
            try:
                self.drafter.extend([inp])
                good.append(inp)
            except Exception as e:
                self._fail([inp], e, errors)
        return good

    def _fail(self, inputs: list[ExtendInput], error: Exception, errors: dict) -> None:
        if not isinstance(error, SpecmeshError):
            log.exception("draft step failed for %s", [i.rid for i in inputs])
        for inp in inputs:
            errors[inp.rid] = as_specmesh_error(error, inp.rid)
            with contextlib.suppress(KeyError):
                self.drafter.release(inp.rid)
            self.live.pop(inp.rid, None)
            self.grammars.release(inp.rid)
            if self.ahead is not None:
                self.ahead.release(inp.rid)

    def release(self, rid: str) -> bool:
        """Free ``rid``'s draft state; False (a no-op) when it holds none."""
        self.grammars.release(rid)
        if self.live.pop(rid, None) is None:
            return False
        self.drafter.release(rid)
        if self.ahead is not None:
            self.ahead.release(rid)
        return True


@dataclass
class _AfterStep:
    extends: list[ExtendInput]  # answered from pre-drafts, not run yet
    hits: dict[str, Outcome]  # their outcomes
    rids: list[str]  # the requests to pre-draft for next


def _wire(tree: Tree) -> DraftTree:
    """The drafter's tree as it leaves the service: tokens and parents, nothing derived."""
    return DraftTree.of(tree.tokens.tolist(), tree.parents.tolist())


def load_draft(cfg: DraftConfig, target_model: torch.nn.Module | None = None) -> DraftRuntime:
    """Build the drafter for ``cfg.kind``. ``target_model`` (in-process) shares the target's
    embedding and head; otherwise they are read from ``cfg.target_dir``."""
    from specmesh.draft_service import kinds
    from specmesh.runtime.llava_checkpoint import target_model_config

    if cfg.kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {cfg.kind!r}; choose from {', '.join(DRAFT_KINDS)}")
    if cfg.kind != "ngram" and not (cfg.draft_dir and Path(cfg.draft_dir).is_dir()):
        raise ValueError(f"draft kind {cfg.kind!r} needs --draft-model DIR, got {cfg.draft_dir!r}")
    target = target_model_config(cfg.target_dir)
    cfg = replace(
        cfg, max_context=resolve_max_context(cfg.max_context, target.max_position, cfg.target_dir)
    )
    drafter = kinds.build_drafter(cfg, target_model)
    if cfg.prefix_cache_tokens > 0 and isinstance(drafter, TreeDrafter):
        drafter.enable_prefix_cache(cfg.prefix_cache_tokens, cfg.prefix_block_size)
    if isinstance(drafter, TreeDrafter) and graphs_enabled(
        cfg.cuda_graph, cfg.device, cfg.attention_backend
    ):
        drafter.enable_step_graphs("cuda-graph", cfg.cuda_graph_max_bs)
    return DraftRuntime(cfg, drafter, target)
