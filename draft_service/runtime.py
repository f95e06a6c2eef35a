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
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from specmesh.draft_service.drafter import TreeDrafter
from specmesh.draft_service.grammar import BatchGrammar, DraftGrammars
from specmesh.draft_service.predraft import PreDrafter
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

log = logging.getLogger(__name__)


class Drafter(Protocol):
    needs: FeatureSpec
    spec: SpecParams

    def extend(self, inputs: list[ExtendInput]) -> None:
        """Validate every input, then forward them as one batch (state changes only after)."""

    def propose(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None = None
    ) -> list[DraftTree]:
        """A tree per request (tokens and parents, as they go on the wire); ``grammar``'s constrained requests' hold only allowed tokens."""

    def release(self, rid: str) -> None: ...
    def check_context(self, rid: str, num_new_tokens: int) -> None:
        """Raise unless the request fits its extend and one tree (before any forward)."""


class DraftRuntime:
    def __init__(self, cfg: DraftConfig, drafter: Drafter, target: ModelConfig) -> None:
        self.cfg, self.drafter, self.target = cfg, drafter, target
        self.live: dict[str, int] = {}  # the requests held -> pending token (next tree's root)
        # Constrained requests' matchers, compiled with the target's tokenizer (never pre-drafted)
        self.grammars = DraftGrammars(
            Grammars(cfg.target_dir, target.vocab_size, target.eos_token_ids)
        )

    def share_grammars(self, grammars: Grammars) -> None:
        """In process: compile constraints with the target's ``grammars`` (the same tokenizer
        and vocabulary), whose prefill compiled each one before the draft's starting extend
        asks: the draft then compiles nothing on its step thread, and no constraint twice."""
        mine = self.grammars.grammars
        if (grammars.vocab_size, set(grammars.eos_ids)) != (mine.vocab_size, set(mine.eos_ids)):
            raise ValueError(
                f"the target's grammars (vocabulary {grammars.vocab_size}, EOS "
                f"{sorted(grammars.eos_ids)}) are not the draft's ({mine.vocab_size}, "
                f"{sorted(mine.eos_ids)})"
            )
        self.grammars.grammars = grammars

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
    ahead: PreDrafter | None = None  # pre-drafting (`PredraftRuntime`); absent here
    pending = None  # work left for after the answer (`PredraftRuntime.after_step`); none here
    # `OnlineLearner` (--online-learning, `specmesh.draft_service.online`): keeps the rows of
    # each extend and swaps a new version of the head in before one; absent here
    learner = None

    def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        """Extend every request over its newly committed tokens, then (optionally) propose the
        next tree for each. A request that fails is dropped; the others are served."""
        result = DraftStepResult()
        ok = self._admit_all(extends, result.errors)
        ok = self._extend(ok, result.errors)
        if propose:
            self._propose(ok, result)
        return result

    def _admit_all(
        self, extends: list[ExtendInput], errors: dict[str, SpecmeshError]
    ) -> list[ExtendInput]:
        """The extends that pass `_admit`, now held with their pending tokens."""
        ok = [e for e in extends if self._admit(e, errors)]
        for inp in ok:
            self.live[inp.rid] = inp.next_token
        return ok

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
        rids, roots = [i.rid for i in ok], [i.next_token for i in ok]
        # None unless one of them is constrained
        grammar = self.grammars.batch(rids) if self.grammars.tracks else None
        try:
            trees = self._trees(rids, roots, grammar)
            result.trees.update({i.rid: t for i, t in zip(ok, trees, strict=True)})
            if self.learner is not None:
                result.versions.update(dict.fromkeys(rids, self.learner.info.version))
        except Exception as e:
            self._fail(ok, e, result.errors)

    def _trees(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None
    ) -> list[DraftTree]:
        propose = self.drafter.propose
        return propose(rids, roots) if grammar is None else propose(rids, roots, grammar)

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
            if inp.constraint is not None or self.grammars.tracks:
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
        if self.learner is not None:  # between two steps: every step runs one version
            self.learner.swap()
        try:
            self.drafter.extend(inputs)  # the batched fast path
            if self.learner is not None:
                self.learner.observe(inputs)
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
        if self.learner is not None:
            self.learner.observe(good)
        return good

    def _fail(self, inputs: list[ExtendInput], error: Exception, errors: dict) -> None:
        if not isinstance(error, SpecmeshError):
            log.exception("draft step failed for %s", [i.rid for i in inputs])
        for inp in inputs:
            errors[inp.rid] = as_specmesh_error(error, inp.rid)
            with contextlib.suppress(KeyError):
                self.drafter.release(inp.rid)
            self.live.pop(inp.rid, None)
            self._forget(inp.rid)

    def release(self, rid: str) -> bool:
        """Free ``rid``'s draft state; False (a no-op) when it holds none."""
        if self.live.pop(rid, None) is None:
            self.grammars.release(rid)
            return False
        self.drafter.release(rid)
        self._forget(rid)
        return True

    def _forget(self, rid: str) -> None:
        """Drop what the runtime keeps of ``rid`` beside the drafter's state."""
        self.grammars.release(rid)
        if self.learner is not None:
            self.learner.forget(rid)


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
    if isinstance(drafter, TreeDrafter) and cfg.cuda_graph:
        # CUDA graphs where the device and backend take them; elsewhere the decode steps still
        # run the same static layout, eagerly (`step_batch`), and extends stay ragged
        if graphs_enabled(cfg.cuda_graph, cfg.device, cfg.attention_backend):
            drafter.enable_step_graphs("cuda-graph", cfg.cuda_graph_max_bs)
        else:
            drafter.enable_step_graphs("eager-static", cfg.cuda_graph_max_bs, extend=False)
    if cfg.predraft and isinstance(drafter, TreeDrafter) and drafter.supports_predraft:
        from specmesh.draft_service.predraft_runtime import PredraftRuntime

        return _learning(PredraftRuntime(cfg, drafter, target))
    return _learning(DraftRuntime(cfg, drafter, target))


def _learning(runtime: DraftRuntime) -> DraftRuntime:
    """``runtime``, with its online learner when ``cfg.online_learning`` asks for one."""
    if runtime.cfg.online_learning:
        from specmesh.draft_service.online import OnlineSettings, attach_learner

        rate = runtime.cfg.online_learning_rate
        attach_learner(runtime, None if rate is None else OnlineSettings(lr=rate))
    return runtime
