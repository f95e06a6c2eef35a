"""The router's scheduler and speculative loop, shared by the in-process `Engine` and the gRPC
router. One round for a micro-batch reads like the algorithm (`specmesh.router.round`):

    trees  = proposals from the last draft step       (propose)
    out    = target.verify(trees)                      (verify: accept path + bonus)
    emit(out.tokens)                                    (stream; stop rules applied per token)
    trees  = draft.step(extend over accepted, propose)  (draft extend + next proposal)

``num_micro_batches`` workers run rounds concurrently (two over gRPC, one in process), so the
target verifies one micro-batch while the draft extends and proposes for another. Requests join
a micro-batch between rounds (continuous batching) and leave when finished. A request is pinned
to one target and one draft replica (least loaded at admission, `specmesh.router.placement`);
each replica's connection, breaker and deadline live in a `specmesh.router.replica.Replica`.
Admission is first come, first served: a request that no replica has room for (each holds at
most its ``--max-requests``) waits at the head of the queue until one frees a place. The core
runs `Slot`s: a request (`Request`, what its client reads) with what the scheduler keeps.

Lifecycle. The worker running a request is the only code that creates or frees its state in
the services: a client that cancels (or whose deadline passes) only marks the request aborted;
the worker, between two of its awaits, has it `leave` its replicas, which releases it in-band
on their Step streams, behind every step already sent for it. A request that leaves to be
replayed is released before it is queued again, so its new state can never be freed by the old
release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from specmesh.protocol.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheFullError,
    ServiceDownError,
    SpecmeshError,
)
from specmesh.protocol.features import FeatureSpec, draft_needs
from specmesh.protocol.steps import TargetInfo
from specmesh.router.clients import DraftClient, TargetClient
from specmesh.router.limits import check_stop_rules
from specmesh.router.metrics import RouterMetrics, counts_rejections
from specmesh.router.placement import Balancer
from specmesh.router.policy import SpeculationPolicy
from specmesh.router.replica import DraftReplica, TargetReplica
from specmesh.router.request import Chunk, Request
from specmesh.router.round import RoundRunner
from specmesh.router.router_config import RouterConfig
from specmesh.router.slot import Slot
from specmesh.rpc.security import model_name

log = logging.getLogger(__name__)


class RouterCore:
    def __init__(
        self,
        targets: list[TargetClient],
        drafts: list[DraftClient],
        cfg: RouterConfig = RouterConfig(),
        policy: SpeculationPolicy | None = None,
    ) -> None:
        """``policy``: measurements to start from (an `Engine` keeps one across its runs)."""
        if not targets:
            raise ValueError("the router needs at least one target")
        self.targets, self.drafts, self.cfg = targets, drafts, cfg
        remote = any(t.remote for t in targets)  # in process one full batch is best
        self.num_micro_batches = cfg.micro_batches(remote)
        self.balanced = remote if cfg.balance_micro_batches is None else cfg.balance_micro_batches
        self.policy = policy or SpeculationPolicy(cfg.speculation)
        self.waiting: deque[Slot] = deque()  # waiting for admission, first come first
        # Set when a request arrives or a replica frees a place; cleared by each try to admit.
        self.wakeup = asyncio.Event()
        self.streams: dict[str, asyncio.Queue] = {}
        self.slots: dict[str, Slot] = {}  # every request whose client is still listening
        # Requests placed that speculate but run without a draft (none was live, or theirs lost
        # them): only while there are any does a round look for a draft to give them back.
        self.draftless: set[str] = set()
        self.metrics = RouterMetrics(self)  # records into the process's `metrics.REGISTRY`
        self.replicas = Balancer(
            [TargetReplica(t, cfg.target_cooldown_s, self.policy, self.metrics) for t in targets],
            [DraftReplica(d, cfg.draft_cooldown_s, self.policy, self.metrics, cfg.draft_deadline())
             for d in drafts],
            cfg.placement,
        )  # fmt: skip
        self.rounds = RoundRunner(self)
        self._workers: list[asyncio.Task] = []
        self.metrics.watch()  # the gauges read this core from now on

    @property
    def requests(self) -> dict[str, Request]:
        """Every request whose client is still listening, by id."""
        return {rid: s.request for rid, s in self.slots.items()}

    @property
    def num_live_targets(self) -> int:
        return len(self.replicas.live_targets())

    @property
    def info(self) -> TargetInfo:
        return self.targets[0].info

    @property
    def served_model(self) -> str:
        """What clients call the model: ``served_model_name``, else the name the target reports
        (its Hugging Face id, or its directory's name; in process, its path's `model_name`)."""
        return self.cfg.served_model_name or model_name(self.info.model)

    async def start(self) -> None:
        """The handshake with every target (what the drafts read), then the workers."""
        needs = draft_needs([d.info.needs for d in self.drafts])
        if self.cfg.speculation == "never":  # no draft step ever reads the target's features
            needs = FeatureSpec()
        await asyncio.gather(*(t.configure(needs) for t in self.targets))
        self.metrics.start()  # the services' KV occupancy, polled
        self._workers = [
            asyncio.create_task(self._worker(i)) for i in range(self.num_micro_batches)
        ]

    async def stop(self) -> None:
        for w in self._workers:
            w.cancel()
        self.rounds.cancel_ahead()
        for w in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await w
        await self.metrics.stop()

    # -- client side ---------------------------------------------------------------------------
    @counts_rejections("self")  # each refusal counted by reason (admission_rejections_total)
    def validate(self, req: Request) -> None:
        info = self.info
        if not req.prompt_ids:
            raise InvalidRequestError("empty prompt")
        bad = [t for t in req.prompt_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt ids outside vocab [0, {info.vocab_size}): {bad[:5]}")
        limit = info.max_context - 1
        if len(req.prompt_ids) > limit:
            raise InvalidRequestError(
                f"prompt of {len(req.prompt_ids)} tokens exceeds the limit of {limit}"
            )
        check_stop_rules(req.params, info.vocab_size)
        if req.rid in self.slots:
            raise DuplicateRequestError(f"request id {req.rid!r} is already in use")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise KVCacheFullError(f"{len(self.waiting)} requests are waiting; try again later")

    async def generate(self, req: Request) -> AsyncIterator[Chunk]:
        """Submit ``req`` and yield its chunks; the last has ``finish_reason``. Closing the
        iteration early aborts the request; its worker then frees its state in both services."""
        self.validate(req)
        stream: asyncio.Queue = asyncio.Queue()
        slot = Slot(req)
        self.streams[req.rid], self.slots[req.rid] = stream, slot
        self._enqueue(slot)
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not req.finished:
                req.abort()  # the worker that runs it sees this and has it leave
            self.metrics.on_finish(req)
            self.streams.pop(req.rid, None)
            self.slots.pop(req.rid, None)

    def push(self, req: Request, item: Chunk | Exception) -> None:
        stream = self.streams.get(req.rid)
        if stream is not None and (
            not isinstance(item, Chunk) or item.token_ids or item.finish_reason
        ):
            stream.put_nowait(item)

    def fail(self, req: Request, error: Exception) -> None:
        req.abort()
        self.push(req, error)

    # -- lifecycle (called by the worker that runs the request) ----------------------------------
    async def leave(self, slot: Slot, *, requeue: bool = False) -> None:
        """Release the request in its replicas (in-band, behind its steps) and unpin it; with
        ``requeue`` (its target dropped it for KV space) it then waits to be replayed."""
        held_kv = slot.prefill_sent > 0  # else refused before it held any: a wait, no preemption
        self.draftless.discard(slot.rid)
        placement = slot.unplaced()
        if placement is not None:
            for error in await placement.release(slot.rid):  # freed all the same: it ends
                log.error("request %r: release failed: %r", slot.rid, error)
            self.replicas.unplace(placement)
            self.wakeup.set()  # its places are free (its release is on the way, in-band)
        if requeue and held_kv and not slot.request.finished:
            self.metrics.on_preempted()
        if requeue:
            self._requeue(slot)

    def _requeue(self, slot: Slot) -> None:
        """Wait for admission again, to be replayed (prompt + emitted tokens)."""
        if not slot.request.finished:
            slot.worker = None
            self._enqueue(slot)

    async def failover(self, slots: list[Slot], target: str, error: ServiceDownError) -> None:
        """``target`` is down: replay each request on another replica (prompt + emitted tokens),
        up to ``max_replays`` times; tokens already streamed are never emitted again."""
        self.metrics.on_target_down(target, [s.request for s in slots])
        for s in slots:
            r = s.request
            r.replays += 1
            if r.replays > self.cfg.max_replays:
                gave_up = f"request {r.rid!r}: {error}; gave up after {r.replays - 1} replays"
                self.fail(r, ServiceDownError(gave_up))
            await self.leave(s)
            self._requeue(s)

    async def drop_draft(self, slot: Slot, *, release: bool) -> None:
        """Continue without speculation (for now: `_resume_speculation` may replay it);
        ``release``: free what the draft may hold for it, in-band."""
        slot.draft_dropped()
        placement = slot.placement
        if slot.speculate and placement is not None:  # placed, and not refused for good:
            self.draftless.add(slot.rid)  # `_resume_speculation` may give it a draft back
        if placement is None or placement.draft is None:
            return
        if release:
            await placement.draft.release([slot.rid])
        self.replicas.unpin_draft(placement)
        self.wakeup.set()

    # -- workers -------------------------------------------------------------------------------
    async def _worker(self, index: int) -> None:
        """Rounds of one micro-batch. Each round first sends the next prefill piece of the
        requests still prefilling (within the round's token budget), then verifies the running
        ones: a long prompt delays them by one piece per round, not by the whole prompt."""
        batch: list[Slot] = []  # admitted requests: prefilling, then running
        while True:
            batch += self._admit(batch, index)
            prefilling = [r for r in batch if not r.prefilled]
            if prefilling:
                await self._guarded(self.rounds.prefill, prefilling, index)
                batch[:] = await self._retire(batch, index)
            running = [r for r in batch if r.prefilled]
            if not running:
                if not batch:  # until a request arrives or a place frees up since `_admit`
                    await self.wakeup.wait()
                continue
            await self._guarded(self.rounds.step, running, index)
            batch[:] = await self._retire(batch, index)
            if self.draftless:
                await self._resume_speculation([r for r in batch if r.prefilled])
                batch[:] = await self._retire(batch, index)

    async def _retire(self, running: list[Slot], index: int) -> list[Slot]:
        """Requests still this worker's; the aborted ones leave their replicas."""
        kept = []
        for s in running:
            if s.request.finished and s.placement is not None:
                await self.leave(s)
            elif not s.request.finished and s.worker == index:
                kept.append(s)
        return kept

    async def _resume_speculation(self, running: list[Slot]) -> None:
        """Requests that continued without speculation after a draft failure get a draft back
        once one is proven healthy again (its breaker closed by a successful step): their draft
        state can only be rebuilt from target features of the whole context, so they are
        replayed like after a failover (nothing emitted is lost or repeated)."""
        if not self.replicas.any_draft_healthy():
            return
        for s in running:
            remaining = s.request.params.max_new_tokens - s.request.num_generated
            lost_draft = s.speculate and s.placement is not None and s.placement.draft is None
            if lost_draft and remaining >= self.cfg.resume_min_remaining:
                await self.leave(s)
                self._requeue(s)

    async def _guarded(
        self, fn: Callable[[list[Slot]], Awaitable[None]], slots: list[Slot], index: int
    ) -> None:
        """A bug in one round fails that round's requests (INTERNAL), never the worker."""
        try:
            await fn(slots)
        except Exception as e:
            log.exception("round failed for %d requests", len(slots))
            for s in slots:
                if s.worker != index:  # requeued meanwhile: no longer ours to touch
                    continue
                if not s.request.finished:
                    error = SpecmeshError(f"internal error: {type(e).__name__}: {e}")
                    self.fail(s.request, error)
                await self.leave(s)

    def _enqueue(self, slot: Slot) -> None:
        self.waiting.append(slot)
        self.wakeup.set()

    def _share(self) -> int:
        """A micro-batch's share of the requests held (running or waiting), when admission is
        balanced: the micro-batches overlap only when each has work, so a burst is split (8 at
        once were admitted 7 and 1 by the first worker to wake; docs/speculation.md)."""
        if not self.balanced:
            return self.cfg.max_batch_size
        held = sum(not s.request.finished for s in self.slots.values())
        return max(1, -(-held // self.num_micro_batches))

    def _admit(self, running: list[Slot], index: int) -> list[Slot]:
        """Waiting requests in arrival order, each pinned to replicas with room, up to the
        micro-batch's size; the first that no replica has room for stops admission (it keeps
        its place at the head of the queue)."""
        self.wakeup.clear()  # this try sees every arrival and freed place so far
        new: list[Slot] = []
        if not self.waiting:  # the share counts every request held: only when one may join
            return new
        limit = min(self.cfg.max_batch_size, self._share())
        while len(running) + len(new) < limit and self.waiting:
            slot = self.waiting[0]
            if slot.request.finished:
                self.waiting.popleft()
                continue
            try:
                placement = self.replicas.place(slot.speculate, slot.request.prompt_ids)
            except ServiceDownError as e:
                self.waiting.popleft()
                self.fail(slot.request, e)
                continue
            if placement is None:  # every replica it may use is full: it waits
                break
            self.waiting.popleft()
            slot.placement, slot.worker = placement, index
            if slot.speculate and placement.draft is None:
                self.draftless.add(slot.rid)
            self.metrics.on_admit(slot.request)
            new.append(slot)
        return new
