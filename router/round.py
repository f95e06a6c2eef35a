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
from typing import TYPE_CHECKING

from specmesh.protocol.errors import (
    KVCacheFullError,
    ServiceDownError,
    SpecmeshError,
    UnknownRequestError,
)
from specmesh.protocol.steps import ExtendInput, Logprob, PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.draft_rows import MAX_BACKLOG_ROWS, held_back, split_rows
from specmesh.router.policy import Plan, SpeculationPolicy
from specmesh.router.prefill_plan import next_context_token, plan_pieces, prefill_piece
from specmesh.router.request import Request

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore

log = logging.getLogger(__name__)

# The ids each request committed in a step, read before `emit` appends the step's tokens.
Committed = Callable[[Request], list[int]]


class RoundRunner:
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    @property
    def policy(self) -> SpeculationPolicy:
        return self.core.policy

    async def prefill(self, reqs: list[Request]) -> None:
        """The next prefill piece of each request, as far as the round's budget goes."""
        sizes = plan_pieces(reqs, self.core.cfg.prefill_chunk_tokens)
        chosen = [r for r in reqs if r.rid in sizes]
        await asyncio.gather(*(self._prefill(group, sizes) for group in _by_target(chosen)))

    async def step(self, reqs: list[Request]) -> None:
        await asyncio.gather(*(self._round(group) for group in _by_target(reqs)))

    async def _round(self, reqs: list[Request]) -> None:
        """verify -> emit -> propose, for requests pinned to one target."""
        roots = {r.rid: r.output_ids[-1] for r in reqs}
        trees = [VerifyInput(r.rid, r.tree or DraftTree.chain([roots[r.rid]])) for r in reqs]
        verify = self.core.metrics.timed_target(lambda target: target.verify(trees))
        target, started = reqs[0].placement.target, time.monotonic()
        placed = self.core.replicas.num_placed(target)  # before the step: who may hold KV
        out = await self._target(reqs, verify)
        if out is not None:
            seconds = self.policy.service_time(target.name, started, time.monotonic())
            self._observe(reqs, trees, out, seconds)
            sizes = {v.rid: v.tree.num_nodes for v in trees}
            live = await self._emit(reqs, out, _shared(placed, out), tree_sizes=sizes)
            self.core.metrics.on_round(reqs, trees, out)
            await self._propose(
                live, out, lambda r: [roots[r.rid], *out.tokens[r.rid][:-1]], new=False
            )

    async def _prefill(self, reqs: list[Request], sizes: dict[str, int]) -> None:
        """Send each request's next piece (`prefill_plan`). After its last piece a request
        emits its first token and its draft extends over that piece and proposes; after an
        earlier one its draft only extends over the piece's rows."""
        pieces = {r.rid: prefill_piece(r, sizes[r.rid]) for r in reqs}
        inputs = list(pieces.values())
        prefill = self.core.metrics.timed_prefill(lambda target: target.prefill(inputs))
        target, started = reqs[0].placement.target, time.monotonic()
        placed = self.core.replicas.num_placed(target)  # before the step: who may hold KV
        out = await self._target(reqs, prefill)
        self.policy.service_time(target.name, started, time.monotonic())
        if out is None:
            return
        shared = _shared(placed, out)
        for r in reqs:
            r.prefill_sent += len(pieces[r.rid].input_ids) if r.rid in out.tokens else 0
        more = [r for r in reqs if pieces[r.rid].more_input]
        last = [r for r in reqs if not pieces[r.rid].more_input]
        # A multimodal prompt ran with its image placeholders expanded: the draft's rows
        # follow the expanded ids (the request keeps its original prompt for replays).
        committed = lambda r: out.prompt_ids.get(r.rid) or pieces[r.rid].input_ids
        live = await self._emit(last, out, shared)
        for r in live:
            r.prefilled = True
        await asyncio.gather(
            self._extend_pieces(more, out, pieces, shared),
            self._propose([r for r in live if not pieces[r.rid].input_start], out, committed,
                          new=True),
            self._propose([r for r in live if pieces[r.rid].input_start], out, committed,
                          new=False),
        )  # fmt: skip

    async def _extend_pieces(
        self,
        reqs: list[Request],
        out: StepOutput,
        pieces: dict[str, PrefillInput],
        shared: bool,
    ) -> None:
        """Each request's draft extends over a piece before the last, without proposing: its
        rows pair with the piece's ids and the next piece's first token."""
        rows, groups = split_rows(out), defaultdict(list)
        for r in reqs:
            if r.rid in out.errors:
                await self._on_target_error(r, out.errors[r.rid], shared)
            elif not r.finished and r.placement.draft and self.policy.mode != "never":
                piece, (feats, mm) = pieces[r.rid], rows[r.rid]
                first = not piece.input_start
                extend = ExtendInput(r.rid, piece.input_ids, next_context_token(r), feats, mm,
                                     False, new=first)  # fmt: skip
                groups[id(r.placement.draft)].append((r, extend))
        await asyncio.gather(*(self._draft(g, Plan(tree_size=1)) for g in groups.values()))

    def _observe(
        self, reqs: list[Request], trees: list[VerifyInput], out: StepOutput, seconds: float
    ) -> None:
        """What the verify cost, and what each request's tree yielded, for the policy."""
        size = max(v.tree.num_nodes for v in trees)
        self.policy.observe_verify(reqs[0].placement.target.name, len(reqs), size, seconds)
        for r, v in zip(reqs, trees, strict=True):
            draft = r.placement.draft if r.placement is not None else None
            if draft is not None and v.tree.num_nodes > 1 and r.rid in out.tokens:
                self.policy.observe_round(draft.name, r.acceptance, v.tree, out.tokens[r.rid])

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

    async def _emit(
        self,
        reqs: list[Request],
        out: StepOutput,
        shared: bool,
        tree_sizes: dict[str, int] | None = None,
    ) -> list[Request]:
        """Stream each request's new tokens (``tree_sizes``: the trees a verify round checked,
        absent for a prefill); returns those that go on speculating. ``shared``: whether the
        step's KV failures wait (`_shared`)."""
        live = []
        for r in reqs:
            if r.rid in out.errors:
                await self._on_target_error(r, out.errors[r.rid], shared)
            elif not r.finished:  # an abort while the step ran: the worker retires it
                chunk = r.emit(
                    out.tokens[r.rid],
                    tree_size=None if tree_sizes is None else tree_sizes[r.rid],
                    logprobs=out.logprobs.get(r.rid),
                    prompt_logprobs=_prompt_logprobs(out.prompt_logprobs.get(r.rid)),
                )
                if r.finished:  # free the state before the client hears the end
                    await self.core.leave(r)
                self.core.push(r, chunk)
                if not r.finished:
                    live.append(r)
        return live

    async def _on_target_error(self, r: Request, error: Exception, shared: bool) -> None:
        """A full KV cache that other requests held during the step (``shared``, `_shared`)
        means "wait": the target dropped the request (preempted it), which goes back to the
        queue to be replayed (context + emitted tokens) once space frees up, whatever its step
        was (a prefill, a draft tree, or a bare root: plain decoding, a failed or no draft). A
        request that does not fit in the cache on its own fails, as does any other error."""
        wait = isinstance(error, KVCacheFullError) and shared
        if not wait:
            self.core.fail(r, error)
        await self.core.leave(r, requeue=wait)

    # -- draft ---------------------------------------------------------------------------------
    async def _propose(
        self, live: list[Request], out: StepOutput, committed: Committed, *, new: bool
    ) -> None:
        """Extend each request's draft over what the target committed, then propose its next
        tree, when the policy plans to speculate; requests without a draft, or not speculating,
        verify a bare root (plain decoding) next round."""
        rows = split_rows(out)
        groups: dict[int, list[tuple[Request, ExtendInput]]] = defaultdict(list)
        for r in live:
            draft = r.placement.draft
            if draft is not None and self.policy.mode == "never":
                r.speculate = False  # for good: never resumed
                await self.core.drop_draft(r, release=not new)
            if r.placement.draft is None:
                r.tree, r.draft_backlog = None, []
                continue
            feats, mm = rows.get(r.rid, (None, None))
            ids, nxt = committed(r), out.tokens[r.rid][-1]
            extend = ExtendInput(r.rid, ids, nxt, feats, mm, bool(r.images), new)
            groups[id(draft)].append((r, extend))
        await asyncio.gather(*(self._plan_and_draft(group, len(live)) for group in groups.values()))

    async def _plan_and_draft(
        self, group: list[tuple[Request, ExtendInput]], batch_size: int
    ) -> None:
        """The policy's plan for one draft's requests; without speculation their extends wait
        (`draft_rows.held_back`) and the draft is not called, unless one must go now."""
        placement = group[0][0].placement
        draft = placement.draft
        plan = self.policy.plan(
            placement.target.name, draft.name, batch_size, [r.acceptance for r, _ in group],
            draft.info.num_draft_tokens,
        )  # fmt: skip
        self.core.metrics.on_plan(placement.target.name, plan.tree_size)
        send = []
        for r, extend in group:
            extend = held_back(r, extend)
            rows = len(extend.committed_ids)
            if plan.speculate or (extend.new and extend.is_multimodal) or rows >= MAX_BACKLOG_ROWS:
                send.append((r, extend))
            else:
                r.draft_backlog, r.tree = [extend], None
        if send:
            await self._draft(send, plan)

    async def _draft(self, group: list[tuple[Request, ExtendInput]], plan: Plan) -> None:
        draft = group[0][0].placement.draft
        breaker, deadline = self.core.replicas.breakers[draft.name], self.core.deadlines[draft.name]
        started = time.monotonic()
        try:
            step = draft.step([e for _, e in group], plan.speculate)
            res = await asyncio.wait_for(step, deadline.seconds)
        except Exception as e:  # any draft failure only costs speculation, never a request
            log.warning("draft %s failed (%s: %s); continuing without speculation",
                        draft.name, type(e).__name__, e)  # fmt: skip
            breaker.record_failure()
            self.core.metrics.on_draft_failure(draft.name)
            for r, _ in group:  # undo work it may still do for them (a late answer is dropped)
                await self.core.drop_draft(r, release=True)
            return
        seconds = time.monotonic() - started
        busy = self.policy.service_time(draft.name, started, started + seconds)
        breaker.record_success()
        deadline.observe(seconds)
        self.core.metrics.on_draft_step(draft.name, seconds)
        if plan.speculate and _steady([e for _, e in group], draft.info.num_draft_tokens):
            self.policy.observe_draft(draft.name, len(group), busy)
        for r, _ in group:
            if r.rid in res.errors or (plan.speculate and r.rid not in res.trees):
                await self._on_draft_error(r, res.errors.get(r.rid))
            else:
                tree = res.trees.get(r.rid)
                r.tree = None if tree is None else tree.cut(plan.tree_size)

    async def _on_draft_error(self, r: Request, error: Exception | None) -> None:
        """The draft dropped this request. Lost state (the draft restarted: NOT_FOUND) is
        rebuilt later by a replay; a refusal (e.g. images for an n-gram draft) is for good."""
        if not isinstance(error, UnknownRequestError):
            r.speculate = False
        await self.core.drop_draft(r, release=False)


def _shared(placed: int, out: StepOutput) -> bool:
    """Whether the requests that failed step ``out`` shared the target's KV cache with one that
    still held it: ``placed`` were pinned to the target when the step was sent, the failed ones
    among them, and the target dropped every failed one. Counted at send time, not when a
    failure is handled: by then the requests that finished in this step have left, and their KV
    was the pressure (a live count failed a request that only had to wait)."""
    return placed > len(out.errors)


def _steady(extends: list[ExtendInput], num_draft_tokens: int) -> bool:
    """A draft step the policy's cost estimate stands for: each request extends over at most
    one round's tokens (no prompt, no rounds held back)."""
    return all(not e.new and len(e.committed_ids) <= num_draft_tokens for e in extends)


def _prompt_logprobs(entries: list[Logprob] | None) -> list[Logprob | None] | None:
    """The target sends one per prompt token after the first; the first token has none."""
    return None if entries is None else [None, *entries]


def _by_target(reqs: list[Request]) -> list[list[Request]]:
    """Groups per pinned target; requests aborted meanwhile are left for the worker to retire."""
    groups: dict[int, list[Request]] = defaultdict(list)
    for r in reqs:
        if not r.finished:
            groups[id(r.placement.target)].append(r)
    return list(groups.values())
