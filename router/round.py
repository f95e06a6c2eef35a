"""One speculative round (and the prefill that starts one) for the requests of a micro-batch.

Requests are grouped by their pinned target (a `Batch`); batches run concurrently. A round
(`RoundRunner._round`):

    trees = batch.take_trees()                 last proposals, or bare roots
    out   = target.verify(trees)               accepted path + bonus, feature rows
    observe(trees, out)                        what each tree yielded, for the policy
    live  = emit(out)                          stop rules, stream, retire finished
    proposer.propose(live, out, committed)     plan; the draft extends and proposes next trees

A prefill has the same shape: pieces instead of trees, the first token to emit after a last
piece, and a draft extend (without a proposal) after an earlier one.

Faults come back from the replicas already recorded (breakers, deadlines, metrics: `replica`);
the round only acts on them. A target that is down: its requests are replayed on another
replica (`RouterCore.failover`); a request the target preempted for KV space others held
(`Preempted`) waits in the queue to be replayed; any other error fails the request. The draft's
faults: `specmesh.router.propose`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from specmesh.protocol.errors import ServiceDownError, SpecmeshError
from specmesh.protocol.steps import Logprob, PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.prefill_plan import plan_pieces, prefill_piece
from specmesh.router.propose import Proposer
from specmesh.router.replica import Preempted, TargetReplica
from specmesh.router.slot import Slot

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore

Inputs = TypeVar("Inputs")


@dataclass
class Batch:
    """The requests of a micro-batch pinned to one target replica: one step serves them all."""

    target: TargetReplica
    slots: list[Slot]

    def take_trees(self) -> list[VerifyInput]:
        """Each request's proposal, or a bare root (plain decoding); a proposal is verified
        once."""
        trees = [VerifyInput(s.rid, s.tree or DraftTree.chain([s.request.output_ids[-1]]))
                 for s in self.slots]  # fmt: skip
        for s in self.slots:
            s.tree = None
        return trees

    def pieces(self, sizes: dict[str, int]) -> dict[str, PrefillInput]:
        """Each request's next prefill piece, of ``sizes[rid]`` context tokens."""
        return {s.rid: prefill_piece(s, sizes[s.rid]) for s in self.slots}


class RoundRunner:
    def __init__(self, core: RouterCore) -> None:
        self.core, self.policy = core, core.policy
        self.proposer = Proposer(core)

    async def prefill(self, slots: list[Slot]) -> None:
        """The next prefill piece of each request, as far as the round's budget goes."""
        sizes = plan_pieces(slots, self.core.cfg.prefill_chunk_tokens)
        chosen = [s for s in slots if s.rid in sizes]
        await asyncio.gather(*(self._prefill(batch, sizes) for batch in _batches(chosen)))

    async def step(self, slots: list[Slot]) -> None:
        await asyncio.gather(*(self._round(batch) for batch in _batches(slots)))

    async def _round(self, batch: Batch) -> None:
        """verify -> emit -> extend and propose, for requests pinned to one target."""
        trees = batch.take_trees()
        out = await self._target(batch, batch.target.verify, trees)
        if out is None:  # the target failed: its requests were replayed or failed
            return
        self._observe(batch, trees, out)
        live = await self._emit(batch.slots, out, trees)
        await self.proposer.propose(live, out, _verified_ids(live, out))

    async def _prefill(self, batch: Batch, sizes: dict[str, int]) -> None:
        """Send each request's next piece (`prefill_plan`). After its last piece a request
        emits its first token and its draft extends over the prompt and proposes; after an
        earlier one its draft only extends over the piece's rows."""
        pieces = batch.pieces(sizes)
        out = await self._target(batch, batch.target.prefill, list(pieces.values()))
        if out is None:
            return
        for s in batch.slots:
            s.prefill_sent += len(pieces[s.rid].input_ids) if s.rid in out.tokens else 0
            if not pieces[s.rid].input_start and s.rid in out.tokens:  # a first piece
                s.request.cached_tokens = out.cached_tokens.get(s.rid, 0)
        more = await self._settle([s for s in batch.slots if pieces[s.rid].more_input], out)
        live = await self._emit([s for s in batch.slots if not pieces[s.rid].more_input], out)
        for s in live:
            s.prefilled = True
        # A multimodal prompt ran with its image placeholders expanded: the draft's rows follow
        # the expanded ids (the request keeps its original prompt for replays).
        ids = {s.rid: out.prompt_ids.get(s.rid) or pieces[s.rid].input_ids for s in live}
        # A draft that starts a request (its whole prompt) and one that continues it (the last
        # piece of a chunked prompt) are planned and stepped apart.
        starts = [s for s in live if not s.on_draft]
        continues = [s for s in live if s.on_draft]
        await asyncio.gather(
            self.proposer.extend_pieces(more, out, pieces),
            *(self.proposer.propose(group, out, ids) for group in (starts, continues)),
        )

    # -- target --------------------------------------------------------------------------------
    async def _target(
        self,
        batch: Batch,
        step: Callable[[Inputs], Awaitable[StepOutput]],
        inputs: Inputs,
    ) -> StepOutput | None:
        """The target's answer to ``step(inputs)``, or None when it failed as a whole."""
        try:
            return await step(inputs)
        except ServiceDownError as e:  # each request is replayed on another replica
            await self.core.failover(batch.slots, batch.target.name, e)
        except SpecmeshError as e:
            for s in batch.slots:
                self.core.fail(s.request, e)
                await self.core.leave(s)
        return None

    async def _settle(self, slots: list[Slot], out: StepOutput) -> list[Slot]:
        """The requests the target answered; each one it failed leaves (`_on_target_error`)."""
        kept = []
        for s in slots:
            if s.rid in out.errors:
                await self._on_target_error(s, out.errors[s.rid])
            else:
                kept.append(s)
        return kept

    async def _on_target_error(self, s: Slot, error: Exception) -> None:
        """A preempted request (`Preempted`) goes back to the queue to be replayed (context +
        emitted tokens) once space frees up, whatever its step was (a prefill, a draft tree, or
        a bare root). Any other error fails it."""
        wait = isinstance(error, Preempted)
        if not wait:
            self.core.fail(s.request, error)
        await self.core.leave(s, requeue=wait)

    # -- emit ----------------------------------------------------------------------------------
    async def _emit(
        self, slots: list[Slot], out: StepOutput, trees: list[VerifyInput] | None = None
    ) -> list[Slot]:
        """Stream each request's new tokens (``trees``: what a verify round checked, absent for
        a prefill); returns those that go on."""
        sizes = {v.rid: v.tree.num_nodes for v in trees or ()}
        live = []
        for s in await self._settle(slots, out):
            r = s.request
            if r.finished:  # an abort while the step ran: the worker retires it
                continue
            chunk = r.emit(
                out.tokens[s.rid],
                tree_size=sizes.get(s.rid),
                logprobs=out.logprobs.get(s.rid),
                prompt_logprobs=_prompt_logprobs(out.prompt_logprobs.get(s.rid)),
            )
            if r.finished:  # free the state before the client hears the end
                await self.core.leave(s)
            self.core.push(r, chunk)
            if not r.finished:
                live.append(s)
        if trees is not None:
            self.core.metrics.on_round(slots, trees, out)
        return live

    def _observe(self, batch: Batch, trees: list[VerifyInput], out: StepOutput) -> None:
        """What each request's tree yielded, for the policy (its record and its draft's)."""
        for s, v in zip(batch.slots, trees, strict=True):
            draft = s.placement.draft if s.placement is not None else None
            if draft is not None and v.tree.num_nodes > 1 and s.rid in out.tokens:
                self.policy.observe_round(draft.name, s.acceptance, v.tree, out.tokens[s.rid])


def _verified_ids(live: list[Slot], out: StepOutput) -> dict[str, list[int]]:
    """What a verify committed for each request that goes on: the root and the accepted tokens
    (the bonus token is pending). ``emit`` appended all of ``out``'s tokens to a live request."""
    return {s.rid: s.request.output_ids[-len(out.tokens[s.rid]) - 1 : -1] for s in live}


def _prompt_logprobs(entries: list[Logprob] | None) -> list[Logprob | None] | None:
    """The target sends one per prompt token after the first; the first token has none."""
    return None if entries is None else [None, *entries]


def _batches(slots: list[Slot]) -> list[Batch]:
    """Batches per pinned target; requests aborted meanwhile are left for the worker to
    retire."""
    groups: dict[TargetReplica, list[Slot]] = {}
    for s in slots:
        if not s.request.finished:
            groups.setdefault(s.placement.target, []).append(s)
    return [Batch(target, group) for target, group in groups.items()]
