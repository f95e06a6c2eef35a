"""One speculative round (and the prefill that starts one), for the requests of a micro-batch.

Requests are grouped by their pinned target and draft replicas; groups run concurrently. Faults:
a draft that fails or misses its deadline opens its circuit breaker and its requests continue
without speculation (the target decodes one token per round; output is unchanged because the
router, not the draft, owns every token). A target that fails sends its requests back to
admission to be replayed (prompt + emitted tokens) on another replica, at most ``max_replays``
times each; tokens already streamed are never emitted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from specmesh.draft_service.feature_drafter import ExtendInput
from specmesh.router.faults import ServiceDownError
from specmesh.router.request import Request
from specmesh.runtime.errors import KVCacheFullError, SpecmeshError
from specmesh.runtime.tree import Tree
from specmesh.target_service.steps import PrefillInput, StepOutput, VerifyInput

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore

log = logging.getLogger(__name__)


class RoundRunner:
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def prefill(self, reqs: list[Request]) -> None:
        await asyncio.gather(*(self._prefill_group(rs) for rs in _by(reqs, "target")))

    async def step(self, reqs: list[Request]) -> None:
        await asyncio.gather(*(self._verify_group(rs) for rs in _by(reqs, "target")))

    # -- target --------------------------------------------------------------------------------
    async def _prefill_group(self, reqs: list[Request]) -> None:
        inputs = [
            PrefillInput(r.rid, r.context_ids(), r.params, r.num_generated, images=r.images)
            for r in reqs
        ]
        out = await self._call_target(reqs, reqs[0].target.prefill(inputs))
        if out is not None:
            # A multimodal prompt ran with its image placeholders expanded: the draft's rows
            # follow the expanded ids (the request keeps its original prompt for replays).
            committed = lambda r: out.prompt_ids.get(r.rid) or r.context_ids()
            await self._advance(reqs, out, committed=committed, new=True)

    async def _verify_group(self, reqs: list[Request]) -> None:
        inputs = [
            VerifyInput(r.rid, r.tree or Tree.chain([r.output_ids[-1]]), r.params, r.num_generated)
            for r in reqs
        ]
        roots = {r.rid: r.output_ids[-1] for r in reqs}
        out = await self._call_target(reqs, reqs[0].target.verify(inputs))
        if out is not None:
            await self._advance(
                reqs, out, committed=lambda r: [roots[r.rid], *out.tokens[r.rid][:-1]], new=False
            )

    async def _call_target(self, reqs: list[Request], call) -> StepOutput | None:
        try:
            return await call
        except ServiceDownError as e:
            self.core.target_breakers[reqs[0].target.name].record_failure()
            for r in reqs:
                r.replays += 1
                if r.replays > self.core.cfg.max_replays:
                    self.core.fail(
                        r,
                        ServiceDownError(
                            f"request {r.rid!r}: {e}; gave up after {r.replays - 1} replays"
                        ),
                    )
                    await self.core.finish(r)
                else:
                    if r.draft is not None:  # the replay starts the draft afresh
                        with contextlib.suppress(Exception):
                            await r.draft.release([r.rid])
                    self.core.requeue(r)
            return None
        except SpecmeshError as e:
            for r in reqs:
                self.core.fail(r, e)
                await self.core.finish(r)
            return None

    async def _advance(self, reqs: list[Request], out: StepOutput, committed, new: bool) -> None:
        """Emit each request's tokens, release finished ones, extend the draft for the rest."""
        rows = _split(out, reqs)
        extends: list[tuple[Request, ExtendInput]] = []
        for r in reqs:
            if r.rid in out.errors:
                await self._on_error(r, out.errors[r.rid])
                continue
            ids = committed(r)  # read before emit() appends this step's tokens
            chunk = r.emit(out.tokens[r.rid], accepted_round=not new)
            if r.finished:  # free the KV before the client hears the end
                await self.core.finish(r)
            self.core.push(r, chunk)
            if r.finished:
                continue
            if r.draft is not None:
                feats, mm = rows.get(r.rid, (None, None))
                extends.append(
                    (
                        r,
                        ExtendInput(
                            r.rid, ids, out.tokens[r.rid][-1], feats, mm, bool(r.images), new
                        ),
                    )
                )
            else:
                r.tree = None
        await asyncio.gather(*(self._draft_group(group) for group in _by_draft(extends)))

    async def _on_error(self, r: Request, error: Exception) -> None:
        """A full KV cache while other requests hold it means "wait": the request's state is
        released in both services and it goes back to the queue, to be replayed (prompt +
        emitted tokens) once space frees up. Anything else fails the request."""
        busy = r.target is not None and self.core.load[r.target.name] > 1
        await self.core.finish(r)
        if isinstance(error, KVCacheFullError) and busy:
            self.core.requeue(r)
        else:
            self.core.fail(r, error)

    # -- draft ---------------------------------------------------------------------------------
    async def _draft_group(self, group: list[tuple[Request, ExtendInput]]) -> None:
        draft = group[0][0].draft
        breaker = self.core.breakers[draft.name]
        try:
            res = await asyncio.wait_for(
                draft.step([e for _, e in group]), self.core.cfg.draft_timeout_s
            )
        except Exception as e:  # any draft failure only costs speculation, never a request
            log.warning(
                "draft %s failed (%s: %s); continuing without speculation",
                draft.name,
                type(e).__name__,
                e,
            )
            breaker.record_failure()
            for r, _ in group:
                self._stop_speculating(r)
            return
        breaker.record_success()
        for r, _ in group:
            if r.rid in res.trees:
                r.tree = res.trees[r.rid]
            else:  # the draft refused this request (e.g. images for an n-gram draft): for good
                r.speculate = False
                self._stop_speculating(r)

    def _stop_speculating(self, r: Request) -> None:
        if r.draft is not None:
            self.core.load[r.draft.name] -= 1
        r.draft, r.tree = None, None


def _by(reqs: list[Request], attr: str) -> list[list[Request]]:
    groups: dict[int, list[Request]] = defaultdict(list)
    for r in reqs:
        groups[id(getattr(r, attr))].append(r)
    return list(groups.values())


def _by_draft(pairs: list[tuple[Request, ExtendInput]]) -> list[list[tuple[Request, ExtendInput]]]:
    groups: dict[int, list] = defaultdict(list)
    for r, e in pairs:
        groups[id(r.draft)].append((r, e))
    return list(groups.values())


def _split(
    out: StepOutput, reqs: list[Request]
) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Cut the batch's feature rows (and multimodal embeddings) back into per-request tensors."""
    rows, start = {}, 0
    for r in reqs:
        n = out.row_counts.get(r.rid)
        if n is None:
            continue
        cut = lambda t: None if t is None else t[start : start + n]  # noqa: B023
        rows[r.rid] = (cut(out.features), cut(out.mm_input_embeds))
        start += n
    return rows
