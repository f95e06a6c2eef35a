"""The draft side of a round: extend each request's draft over what the target committed, then
propose its next tree, as the speculation policy plans for each draft replica's requests.

Whether an extend starts a request's draft state or continues it is the slot's state
(`Slot.on_draft`: an extend was sent to that draft since the request was placed), never a flag
passed down. A request's tree is None unless its draft just proposed one: it then verifies a
bare root (plain decoding).

Faults, here only as actions (the `DraftReplica` recorded them): a draft step that failed or
missed its deadline releases its requests there in-band (a late answer is dropped) and they
continue without speculation (output is unchanged: the router, not the draft, owns every token);
a draft that answered one request with an error dropped that request's state.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

from specmesh.protocol.errors import UnknownRequestError
from specmesh.protocol.steps import DraftStepResult, ExtendInput, PrefillInput, StepOutput
from specmesh.router.draft_rows import must_send, split_rows, with_backlog
from specmesh.router.policy import Plan
from specmesh.router.prefill_plan import next_context_token
from specmesh.router.replica import DraftReplica, together

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore
    from specmesh.router.slot import Slot

Sent = list[tuple["Slot", ExtendInput]]


class Proposer:
    def __init__(self, core: RouterCore) -> None:
        self.core, self.policy = core, core.policy

    async def propose(self, live: list[Slot], out: StepOutput, ids: dict[str, list[int]]) -> None:
        """Each request's draft extends over ``ids[rid]`` (what the target committed: ``out``
        holds their rows) and proposes the next tree, per draft as its plan says; ``live`` are
        the requests of one target step that go on, before ``out``'s tokens are emitted (the
        round emits them while the draft works)."""
        if self.policy.mode == "never":  # for good: never resumed
            await self._stop_speculating(live)
        rows, groups = split_rows(out), defaultdict(list)
        for s in live:
            if s.placement.draft is not None:
                feats, mm = rows.get(s.rid, (None, None))
                extend = ExtendInput(s.rid, ids[s.rid], out.tokens[s.rid][-1], feats, mm,
                                     bool(s.request.images), learn=s.request.learn)  # fmt: skip
                if not s.on_draft and not s.draft_backlog:  # it starts: the whole context
                    _constrain(extend, s, len(ids[s.rid]) - s.request.num_generated)
                groups[s.placement.draft].append((s, extend))
        await together(self._plan_and_draft(d, g, len(live)) for d, g in groups.items())

    async def prepare(self, slots: list[Slot], pieces: dict[str, PrefillInput]) -> None:
        """Each draft starts compiling the constraints of the requests whose prefill starts now
        (a first piece), while the target compiles them for it: the requests' starting extends
        then find them compiled instead of compiling in turn."""
        if self.policy.mode == "never":
            return
        groups = defaultdict(list)
        for s in slots:
            constraint = s.request.params.constraint
            first = s.rid in pieces and not pieces[s.rid].input_start
            if constraint is not None and first and s.speculate and s.placement.draft is not None:
                groups[s.placement.draft].append(constraint)
        for draft, constraints in groups.items():
            await draft.client.prepare(constraints)

    async def extend_pieces(
        self, slots: list[Slot], out: StepOutput, pieces: dict[str, PrefillInput]
    ) -> None:
        """Each request's draft extends over a piece before the last, without proposing: its
        rows pair with the piece's ids and the next piece's first token."""
        if self.policy.mode == "never":
            return
        rows, groups = split_rows(out), defaultdict(list)
        for s in slots:
            if not s.request.finished and s.placement.draft is not None:
                feats, mm = rows[s.rid]
                extend = ExtendInput(s.rid, pieces[s.rid].input_ids, next_context_token(s),
                                     feats, mm, False, new=not s.on_draft,
                                     learn=s.request.learn)  # fmt: skip
                if extend.new:  # a first piece: the output starts after the prompt
                    _constrain(extend, s, len(s.request.prompt_ids))
                groups[s.placement.draft].append((s, extend))
        await together(self._step(d, g, Plan(tree_size=1)) for d, g in groups.items())

    async def _plan_and_draft(self, draft: DraftReplica, group: Sent, batch: int) -> None:
        """The policy's plan for one draft's requests (``batch``: all that the target verifies
        together); without speculation their extends wait and the draft is not called, unless
        one must go now."""
        target = group[0][0].placement.target
        plan = self.policy.plan(target.name, draft.name, batch, [s.acceptance for s, _ in group],
                                draft.info.num_draft_tokens)  # fmt: skip
        self.core.metrics.on_plan(target.name, plan.tree_size)
        if not plan.speculate and plan.reason is not None:
            for s, _ in group:  # why, for the request's stats (`RequestStats.plain_reason`)
                s.request.last_plain = plan.reason
        send = []
        for s, extend in group:
            extend = with_backlog(s, extend)
            if plan.speculate or must_send(extend):
                send.append((s, extend))
            else:
                s.draft_backlog = [extend]
        if send:
            await self._step(draft, send, plan)

    async def _step(self, draft: DraftReplica, sent: Sent, plan: Plan) -> None:
        """One draft step; each request gets its next tree (cut to the plan) or loses its
        draft. A request the round's emit finished while the step ran has left: what the
        answer says of it changes nothing, and its release followed the step."""
        for s, _ in sent:
            s.on_draft = True  # the step creates its state there, whatever it answers
        started = time.perf_counter()
        res = await draft.step([e for _, e in sent], plan)
        if plan.speculate:  # the verify waits on this answer
            _count_wait(sent, res, time.perf_counter() - started)
        if res is None:  # failed or late: undo work it may still do for them
            for s, _ in sent:
                await self.core.drop_draft(s, release=True)
            return
        for s, _ in sent:
            if s.rid in res.errors or (plan.speculate and s.rid not in res.trees):
                await self._on_draft_error(s, res.errors.get(s.rid))
            else:
                tree = res.trees.get(s.rid)
                s.tree = None if tree is None else tree.cut(plan.tree_size)

    async def _on_draft_error(self, s: Slot, error: Exception | None) -> None:
        """The draft dropped this request. Lost state (the draft restarted: NOT_FOUND) is
        rebuilt later by a replay; a refusal (e.g. images for an n-gram draft) is for good."""
        if not isinstance(error, UnknownRequestError):
            s.speculate = False
        await self.core.drop_draft(s, release=False)

    async def _stop_speculating(self, live: list[Slot]) -> None:
        """Speculation is "never": each request goes on without its draft, for good."""
        for s in live:
            if s.placement.draft is not None:
                s.speculate = False
                await self.core.drop_draft(s, release=s.on_draft)


def _constrain(extend: ExtendInput, s: Slot, output_start: int) -> None:
    """A starting extend carries the request's grammar, if any, and where its output begins
    (``output_start`` ids into this extend's): the draft then proposes only what the grammar
    allows (`draft_service.grammar`)."""
    extend.constraint = s.request.params.constraint
    extend.output_start = output_start if extend.constraint is not None else 0


def _count_wait(sent: Sent, res: DraftStepResult | None, seconds: float) -> None:
    """Per request: the time its next verify waited on this draft step, whether the tree was
    pre-drafted, and the draft weights' version it was drafted with (a learning draft's)."""
    for s, _ in sent:
        s.request.draft_wait_s += seconds
        s.request.num_predraft_hits += res is not None and s.rid in res.predrafted
    if res is not None and res.versions:
        for s, _ in sent:
            s.request.note_draft_version(res.versions.get(s.rid))
