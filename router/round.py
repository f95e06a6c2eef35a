"""One speculative round (and the prefill that starts one) for the requests of a micro-batch.

Requests are grouped by their pinned target (a `Batch`); batches run concurrently. A round
(`RoundRunner._round`):

    trees, out = verify(batch)                 last proposals or bare roots; the answer of a
                                               step sent ahead, and of a fresh verify
    send_ahead(batch, out)                     plain requests: the next step goes out now
    observe(trees, out)                        what each tree yielded, for the policy
    going = requests the answer leaves tokens to come
    proposer.propose(going, out, committed)    plan; the draft extends and proposes next trees,
      overlapped with                          its step written first, then while it works:
    emit(out)                                  stop rules, stream, retire finished

A prefill has the same shape: pieces instead of trees, the first token to emit after a last
piece, and a draft extend (without a proposal) after an earlier one. A request the emit
finishes had its draft step sent for nothing: it leaves, and its release follows that step on
the draft's stream (`_overlapped`).

Pipelined plain decoding (`_send_ahead`, `RouterConfig.pipeline_decode`, over gRPC): a request
that decodes without a draft has its next step (its newest token as a one-node tree) sent
before this step's tokens are emitted, so the target computes it (its run-ahead) while the
router emits, and the next round only awaits its answer (`Slot.ahead`). Requests that joined
since get a fresh verify beside it, the two answers joined. A request that stops meanwhile
leaves: its release follows that step on the same stream, and its answer is dropped. Nothing
of an answer is emitted before the round that reads it, so a failover replays it as any other.

Faults come back from the replicas already recorded (breakers, deadlines, metrics: `replica`);
the round only acts on them. A target that is down: its requests are replayed on another
replica (`RouterCore.failover`); a request the target preempted for KV space others held
(`Preempted`) waits in the queue to be replayed; any other error fails the request. The draft's
faults: `specmesh.router.propose`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from specmesh.protocol.errors import ServiceDownError, SpecmeshError
from specmesh.protocol.steps import Logprob, PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.prefill_plan import plan_pieces, prefill_piece
from specmesh.router.propose import Proposer
from specmesh.router.replica import Preempted, TargetReplica, together
from specmesh.router.slot import Ahead, Slot

if TYPE_CHECKING:
    from specmesh.router.core import RouterCore

Inputs = TypeVar("Inputs")


@dataclass
class Batch:
    """The requests of a micro-batch pinned to one target replica: one step serves them all."""

    target: TargetReplica
    slots: list[Slot]

    def take_trees(self, slots: list[Slot]) -> list[VerifyInput]:
        """Each of ``slots``' proposal, cut to the room its target's context has left
        (`_fitted`), or a bare root (plain decoding); a proposal is verified once."""
        max_context = self.target.client.info.max_context
        trees = [VerifyInput(s.rid, _fitted(s, max_context)) for s in slots]
        for s in slots:
            s.tree = None
        return trees

    def pieces(self, sizes: dict[str, int]) -> dict[str, PrefillInput]:
        """Each request's next prefill piece, of ``sizes[rid]`` context tokens."""
        return {s.rid: prefill_piece(s, sizes[s.rid]) for s in self.slots}


def _fitted(s: Slot, max_context: int) -> DraftTree:
    """The slot's proposal, its first nodes only where the whole tree would pass
    ``max_context``: the target holds the context but the pending token (the root), and a tree
    of n nodes needs n more KV slots. Near the end of the context the tree shrinks to a bare
    root, so a request whose prompt + max_new_tokens fits is served to its end."""
    if s.tree is None:
        return DraftTree.chain([s.request.output_ids[-1]])
    held = len(s.request.prompt_ids) + s.request.num_generated - 1
    return s.tree.cut(max(1, max_context - held))


class RoundRunner:
    def __init__(self, core: RouterCore) -> None:
        self.core, self.policy = core, core.policy
        self.proposer = Proposer(core)
        self.pipeline = core.cfg.pipeline_decode  # pipelined plain decoding, over gRPC only
        self.in_flight: set[asyncio.Task] = set()  # steps sent ahead (`Ahead`), until answered

    async def prefill(self, slots: list[Slot]) -> None:
        """The next prefill piece of each request, as far as the round's budget goes."""
        sizes = plan_pieces(slots, self.core.cfg.prefill_chunk_tokens)
        chosen = [s for s in slots if s.rid in sizes]
        await together(self._prefill(batch, sizes) for batch in _batches(chosen))

    async def step(self, slots: list[Slot]) -> None:
        await together(self._round(batch) for batch in _batches(slots))

    async def _round(self, batch: Batch) -> None:
        """verify -> extend and propose, overlapped with the emit, for requests pinned to one
        target."""
        trees, out = await self._verify(batch)
        if out is None:  # the target failed: its requests were replayed or failed
            return
        if self.pipeline and batch.target.client.remote:
            await self._send_ahead(batch, out)
        if self.policy.measures:
            self._observe(batch, trees, out)
        going = [s for s in batch.slots if _goes_on(s, out)]
        drafting = None  # plain decoding: nothing to overlap
        if any(s.placement.draft is not None for s in going):
            drafting = self.proposer.propose(going, out, _verified_ids(going, out))
        await self._overlapped(drafting, self._emit(batch.slots, out, trees))

    async def _prefill(self, batch: Batch, sizes: dict[str, int]) -> None:
        """Send each request's next piece (`prefill_plan`). After its last piece a request
        emits its first token and its draft extends over the prompt and proposes; after an
        earlier one its draft only extends over the piece's rows."""
        pieces = batch.pieces(sizes)
        await self.proposer.prepare(batch.slots, pieces)
        out = await self._target(batch, batch.target.prefill, list(pieces.values()))
        if out is None:
            return
        for s in batch.slots:
            s.prefill_sent += len(pieces[s.rid].input_ids) if s.rid in out.tokens else 0
            if not pieces[s.rid].input_start and s.rid in out.tokens:  # a first piece
                s.request.cached_tokens = out.cached_tokens.get(s.rid, 0)
        more = await self._settle([s for s in batch.slots if pieces[s.rid].more_input], out)
        last = [s for s in batch.slots if not pieces[s.rid].more_input]
        going = [s for s in last if _goes_on(s, out)]
        # A multimodal prompt ran with its image placeholders expanded: the draft's rows follow
        # the expanded ids (the request keeps its original prompt for replays).
        ids = {s.rid: out.prompt_ids.get(s.rid) or pieces[s.rid].input_ids for s in going}
        # A draft that starts a request (its whole prompt) and one that continues it (the last
        # piece of a chunked prompt) are planned and stepped apart.
        starts = [s for s in going if not s.on_draft]
        continues = [s for s in going if s.on_draft]
        drafting = asyncio.gather(
            self.proposer.extend_pieces(more, out, pieces),
            *(self.proposer.propose(group, out, ids) for group in (starts, continues)),
        )
        live = await self._overlapped(drafting, self._emit(last, out))
        for s in live:
            s.prefilled = True

    # -- target --------------------------------------------------------------------------------
    async def _verify(self, batch: Batch) -> tuple[list[VerifyInput], StepOutput | None]:
        """Each request's tree (in the batch's order) and the target's answer: a step sent
        ahead answers its requests, one fresh verify the others, awaited together."""
        aheads = list(dict.fromkeys(s.ahead for s in batch.slots if s.ahead is not None))
        fresh = [s for s in batch.slots if s.ahead is None]
        trees = {v.rid: v for a in aheads for v in a.trees.values()}
        trees |= {v.rid: v for v in batch.take_trees(fresh)}
        steps: list[Awaitable[StepOutput]] = [a.answer for a in aheads]
        if fresh:  # feature rows only where a draft reads them
            rows = any(s.placement.draft is not None for s in fresh)
            steps.append(batch.target.verify([trees[s.rid] for s in fresh], rows))
        for s in batch.slots:
            s.ahead = None
        out = await self._target(batch, _joined, steps)
        if out is not None:  # a step sent ahead also answered requests that left since
            rids = {s.rid for s in batch.slots}
            out.tokens = {rid: t for rid, t in out.tokens.items() if rid in rids}
        return [trees[s.rid] for s in batch.slots], out

    async def _send_ahead(self, batch: Batch, out: StepOutput) -> None:
        """Pipelined plain decoding: each request that decodes without a draft and has tokens
        to come gets its next step (its newest token as a one-node tree) sent now, before this
        step's tokens are emitted. The target computes it (`target_service.run_ahead`) while the
        router emits; the next round only awaits it. A request that stops meanwhile leaves, and
        its release follows the step on the same stream; its answer is dropped."""
        trees = {s.rid: VerifyInput(s.rid, DraftTree.chain([out.tokens[s.rid][-1]]))
                 for s in batch.slots if _decodes_on(s, out)}  # fmt: skip
        if not trees:
            return
        try:
            answer = await batch.target.send_verify(list(trees.values()), rows=False)
        except SpecmeshError:  # not sent: the next round sends its own (and meets the fault)
            return
        ahead = Ahead(asyncio.ensure_future(answer), trees)
        self.in_flight.add(ahead.answer)
        ahead.answer.add_done_callback(self._answered)
        for s in batch.slots:
            if s.rid in trees:
                s.ahead = ahead

    def _answered(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a round that still reads it gets it again

    def cancel_ahead(self) -> None:
        """The router stops: nothing reads the steps sent ahead."""
        for task in list(self.in_flight):
            task.cancel()

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

    @staticmethod
    async def _overlapped(
        drafting: Awaitable[object] | None, emit: Awaitable[list[Slot]]
    ) -> list[Slot]:
        """The draft step goes out first and works while the router emits: its message is
        written (one loop turn runs it up to its first wait) before the emit's stop rules,
        detokenizing and streaming. A request the emit finishes leaves meanwhile: its release
        follows the step on the draft's stream. Returns the emit's live requests."""
        if drafting is None:
            return await emit
        task = asyncio.ensure_future(drafting)
        await asyncio.sleep(0)
        try:
            live = await emit
        except BaseException:
            task.cancel()
            raise
        await task
        return live

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
            if draft is not None and s.rid in out.tokens:
                self.policy.observe_round(draft.name, s.acceptance, v.tree, out.tokens[s.rid])


def _goes_on(s: Slot, out: StepOutput) -> bool:
    """Whether a request will want a next step after this one (unless a stop token or string
    in its new tokens ends it): the target answered it, and these tokens leave more to come."""
    tokens = out.tokens.get(s.rid)
    if not tokens or s.rid in out.errors or s.request.finished or s.placement is None:
        return False
    return s.request.num_generated + len(tokens) < s.request.params.max_new_tokens


def _decodes_on(s: Slot, out: StepOutput) -> bool:
    """Whether a request's next step is a plain decode step it will surely want: it goes on
    (`_goes_on`) without a draft."""
    return _goes_on(s, out) and s.placement.draft is None


async def _joined(steps: list[Awaitable[StepOutput]]) -> StepOutput:
    """One step's answer, or those of several (sent ahead, and fresh) as one. The feature rows
    are the fresh step's: a step sent ahead serves only requests without a draft."""
    if len(steps) == 1:
        return await steps[0]
    outs = await asyncio.gather(*steps, return_exceptions=True)
    for o in outs:
        if isinstance(o, BaseException):
            raise o
    joined = replace(outs[-1], tokens={}, logprobs={}, errors={})
    for o in outs:
        joined.tokens |= o.tokens
        joined.logprobs |= o.logprobs
        joined.errors |= o.errors
    return joined


def _verified_ids(going: list[Slot], out: StepOutput) -> dict[str, list[int]]:
    """What a verify committed for each request that goes on, before its tokens are emitted:
    the root (its newest token) and the accepted tokens (the bonus token is pending)."""
    return {s.rid: [s.request.output_ids[-1], *out.tokens[s.rid][:-1]] for s in going}


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
