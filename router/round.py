"""One speculative round (and the prefill that starts one), for the requests of a micro-batch.

Requests are grouped by their pinned target; groups run concurrently. One round of a group:

    out  = verify(trees)          target: accept a path of each tree, sample the bonus token
    live = emit(out)              stream the tokens (stop rules per token); finished ones leave
    propose(live, out)            draft: extend over the accepted tokens, propose the next trees

Faults, each in a small handler below: a draft that fails or misses its deadline opens its
circuit breaker, its requests are released there in-band and continue without speculation (the
target decodes one token per round; output is unchanged because the router, not the draft,
owns every token). A target that fails sends its requests back to admission to be replayed
(prompt + emitted tokens) on another replica, at most ``max_replays`` times each; tokens
already streamed are never emitted again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from specmesh.draft_service.steps import ExtendInput
from specmesh.router.request import Request, TokenLogprob
from specmesh.runtime.errors import (
    KVCacheFullError,
    ServiceDownError,
    SpecmeshError,
    UnknownRequestError,
)
from specmesh.runtime.sampling import SamplingParams
from specmesh.runtime.tree import Tree
from specmesh.target_service.steps import Logprob, PrefillInput, StepOutput, VerifyInput

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore

log = logging.getLogger(__name__)

# The ids each request committed in a step, read before `emit` appends the step's tokens.
Committed = Callable[[Request], list[int]]


class RoundRunner:
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def prefill(self, reqs: list[Request]) -> None:
        await asyncio.gather(*(self._prefill(group) for group in _by_target(reqs)))

    async def step(self, reqs: list[Request]) -> None:
        await asyncio.gather(*(self._round(group) for group in _by_target(reqs)))

    async def _round(self, reqs: list[Request]) -> None:
        """verify -> emit -> propose, for requests pinned to one target."""
        roots = {r.rid: r.output_ids[-1] for r in reqs}
        trees = [VerifyInput(r.rid, r.tree or Tree.chain([roots[r.rid]])) for r in reqs]
        verify = self.core.metrics.timed_target(lambda target: target.verify(trees))
        out = await self._target(reqs, verify)
        if out is not None:
            live = await self._emit(reqs, out, accepted_round=True)
            self.core.metrics.on_round(reqs, trees, out)
            await self._propose(
                live, out, lambda r: [roots[r.rid], *out.tokens[r.rid][:-1]], new=False
            )

    async def _prefill(self, reqs: list[Request]) -> None:
        inputs = [
            PrefillInput(
                r.rid, r.context_ids(), _prefill_params(r), r.num_generated, images=r.images
            )
            for r in reqs
        ]
        prefill = self.core.metrics.timed_prefill(lambda target: target.prefill(inputs))
        out = await self._target(reqs, prefill)
        if out is not None:
            # A multimodal prompt ran with its image placeholders expanded: the draft's rows
            # follow the expanded ids (the request keeps its original prompt for replays).
            committed = {r.rid: out.prompt_ids.get(r.rid) or r.context_ids() for r in reqs}
            live = await self._emit(reqs, out, accepted_round=False)
            await self._propose(live, out, lambda r: committed[r.rid], new=True)

    # -- target --------------------------------------------------------------------------------
    async def _target(self, reqs: list[Request], call: Callable[..., Awaitable[StepOutput]]):
        try:
            return await call(reqs[0].placement.target)
        except ServiceDownError as e:
            await self._on_target_down(reqs, e)
        except SpecmeshError as e:
            for r in reqs:
                self.core.fail(r, e)
                await self.core.leave(r)
        return None

    async def _on_target_down(self, reqs: list[Request], error: ServiceDownError) -> None:
        """Replay each request on another replica, up to ``max_replays`` times."""
        self.core.replicas.breakers[reqs[0].placement.target.name].record_failure()
        self.core.metrics.on_target_down(reqs)
        for r in reqs:
            r.replays += 1
            if r.replays > self.core.cfg.max_replays:
                gave_up = f"request {r.rid!r}: {error}; gave up after {r.replays - 1} replays"
                self.core.fail(r, ServiceDownError(gave_up))
            await self.core.leave(r, requeue=True)

    async def _emit(self, reqs: list[Request], out: StepOutput, *, accepted_round: bool):
        """Stream each request's new tokens; returns those that go on speculating."""
        live = []
        for r in reqs:
            if r.rid in out.errors:
                await self._on_target_error(r, out.errors[r.rid])
            elif not r.finished:  # an abort while the step ran: the worker retires it
                chunk = r.emit(
                    out.tokens[r.rid],
                    accepted_round=accepted_round,
                    logprobs=_logprobs(out.logprobs.get(r.rid)),
                    prompt_logprobs=_prompt_logprobs(out.prompt_logprobs.get(r.rid)),
                )
                if r.finished:  # free the state before the client hears the end
                    await self.core.leave(r)
                self.core.push(r, chunk)
                if not r.finished:
                    live.append(r)
        return live

    async def _on_target_error(self, r: Request, error: Exception) -> None:
        """A full KV cache while other requests hold it means "wait": the request goes back to
        the queue, to be replayed once space frees up. Anything else fails the request."""
        wait = isinstance(error, KVCacheFullError) and self.core.replicas.busy(r.placement.target)
        if not wait:
            self.core.fail(r, error)
        await self.core.leave(r, requeue=wait)

    # -- draft ---------------------------------------------------------------------------------
    async def _propose(
        self, live: list[Request], out: StepOutput, committed: Committed, *, new: bool
    ) -> None:
        """Extend each request's draft over what the target committed, then propose its next
        tree; requests without a draft verify a bare root (plain decoding) next round."""
        rows = _rows(out)
        groups: dict[int, list[tuple[Request, ExtendInput]]] = defaultdict(list)
        for r in live:
            draft = r.placement.draft
            if draft is None:
                r.tree = None
                continue
            feats, mm = rows.get(r.rid, (None, None))
            ids, nxt = committed(r), out.tokens[r.rid][-1]
            extend = ExtendInput(r.rid, ids, nxt, feats, mm, bool(r.images), new)
            groups[id(draft)].append((r, extend))
        await asyncio.gather(*(self._draft(group) for group in groups.values()))

    async def _draft(self, group: list[tuple[Request, ExtendInput]]) -> None:
        draft = group[0][0].placement.draft
        breaker, deadline = self.core.replicas.breakers[draft.name], self.core.deadlines[draft.name]
        started = time.monotonic()
        try:
            step = draft.step([e for _, e in group])
            res = await asyncio.wait_for(step, deadline.seconds)
        except Exception as e:  # any draft failure only costs speculation, never a request
            log.warning("draft %s failed (%s: %s); continuing without speculation",
                        draft.name, type(e).__name__, e)  # fmt: skip
            breaker.record_failure()
            self.core.metrics.on_draft_failure(draft.name)
            for r, _ in group:  # undo work it may still do for them (a late answer is dropped)
                await self.core.drop_draft(r, release=True)
            return
        breaker.record_success()
        deadline.observe(time.monotonic() - started)
        self.core.metrics.on_draft_step(draft.name, time.monotonic() - started)
        for r, _ in group:
            if r.rid in res.trees:
                r.tree = res.trees[r.rid]
            else:
                await self._on_draft_error(r, res.errors.get(r.rid))

    async def _on_draft_error(self, r: Request, error: Exception | None) -> None:
        """The draft dropped this request. Lost state (the draft restarted: NOT_FOUND) is
        rebuilt later by a replay; a refusal (e.g. images for an n-gram draft) is for good."""
        if not isinstance(error, UnknownRequestError):
            r.speculate = False
        await self.core.drop_draft(r, release=False)


def _prefill_params(r: Request) -> SamplingParams:
    """A request's params for a prefill: prompt logprobs only until they were sent (a replay
    after tokens were emitted, which came with them, does not ask again)."""
    if r.params.prompt_logprobs is None or r.num_generated == 0:
        return r.params
    return replace(r.params, prompt_logprobs=None)


def _logprobs(entries: list[Logprob] | None) -> list[TokenLogprob] | None:
    return (
        None if entries is None else [TokenLogprob(e.token_id, e.logprob, e.top) for e in entries]
    )


def _prompt_logprobs(entries: list[Logprob] | None) -> list[TokenLogprob | None] | None:
    """The target sends one per prompt token after the first; the first token has none."""
    return None if entries is None else [None, *_logprobs(entries)]


def _by_target(reqs: list[Request]) -> list[list[Request]]:
    """Groups per pinned target; requests aborted meanwhile are left for the worker to retire."""
    groups: dict[int, list[Request]] = defaultdict(list)
    for r in reqs:
        if not r.finished:
            groups[id(r.placement.target)].append(r)
    return list(groups.values())


def _rows(out: StepOutput) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Cut the batch's feature rows (and multimodal embeddings) back into per-request tensors;
    rows follow the order of ``out.row_counts`` (the batch's order)."""
    rows, start = {}, 0
    for rid, n in out.row_counts.items():
        cut = lambda t: None if t is None else t[start : start + n]  # noqa: B023
        rows[rid] = (cut(out.features), cut(out.mm_input_embeds))
        start += n
    return rows
