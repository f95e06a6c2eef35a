"""The router's scheduler and speculative loop, shared by the in-process `Engine` and the gRPC
router. One round for a micro-batch reads like the algorithm:

    trees  = proposals from the last draft step       (propose)
    out    = target.verify(trees)                      (verify: accept path + bonus)
    emit(out.tokens)                                    (stream; stop rules applied per token)
    trees  = draft.step(extend over accepted, propose)  (draft extend + next proposal)

``num_micro_batches`` workers run rounds concurrently, so the target verifies one micro-batch
while the draft extends and proposes for another. Requests join a micro-batch between rounds
(continuous batching) and leave when finished. A request is pinned to one target and one draft
replica (least loaded at admission).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specmesh.router.clients import DraftClient, TargetClient, TargetInfo
from specmesh.router.faults import CircuitBreaker, ServiceDownError
from specmesh.router.request import Chunk, Phase, Request
from specmesh.router.round import RoundRunner
from specmesh.runtime.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheFullError,
    SpecmeshError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    max_batch_size: int = 32  # requests per micro-batch
    num_micro_batches: int = 2
    max_waiting: int = 4096  # queued requests before admission says RESOURCE_EXHAUSTED
    draft_timeout_s: float = 10.0  # a slower draft step counts as a draft failure
    draft_cooldown_s: float = 5.0  # circuit breaker: how long a failed draft is left alone
    max_replays: int = 2  # target failovers per request before UNAVAILABLE
    target_cooldown_s: float = 10.0  # a failed target replica gets no new requests this long
    # A request that lost its draft is replayed (one prefill of its context) to speculate again
    # once a draft has served a step successfully, if this many tokens are still to come.
    resume_min_remaining: int = 32


class RouterCore:
    def __init__(
        self,
        targets: list[TargetClient],
        drafts: list[DraftClient],
        cfg: RouterConfig = RouterConfig(),
    ) -> None:
        if not targets:
            raise ValueError("the router needs at least one target")
        self.targets, self.drafts, self.cfg = targets, drafts, cfg
        self.breakers = {d.name: CircuitBreaker(cfg.draft_cooldown_s) for d in drafts}
        # A target that failed is left alone for a while, then tried again (it may have
        # restarted); its requests were replayed elsewhere meanwhile.
        self.target_breakers = {t.name: CircuitBreaker(cfg.target_cooldown_s) for t in targets}
        self.load: dict[str, int] = {c.name: 0 for c in [*targets, *drafts]}
        self.waiting: asyncio.Queue[Request] = asyncio.Queue()
        self.streams: dict[str, asyncio.Queue] = {}
        self.requests: dict[str, Request] = {}
        self.rounds = RoundRunner(self)
        self._workers: list[asyncio.Task] = []

    @property
    def num_live_targets(self) -> int:
        return sum(b.allows() for b in self.target_breakers.values())

    @property
    def info(self) -> TargetInfo:
        return self.targets[0].info

    async def start(self) -> None:
        draft_info = self.drafts[0].info if self.drafts else None
        for t in self.targets:
            await t.configure(draft_info)
        self._workers = [
            asyncio.create_task(self._worker(i)) for i in range(self.cfg.num_micro_batches)
        ]

    async def stop(self) -> None:
        for w in self._workers:
            w.cancel()
        for w in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await w

    # -- client side ---------------------------------------------------------------------------
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
        req.params.validate()
        if req.rid in self.requests:
            raise DuplicateRequestError(f"request id {req.rid!r} is already in use")
        if self.waiting.qsize() >= self.cfg.max_waiting:
            raise KVCacheFullError(f"{self.waiting.qsize()} requests are waiting; try again later")

    async def generate(self, req: Request) -> AsyncIterator[Chunk]:
        """Submit ``req`` and yield its chunks; the last has ``finish_reason``. Cancelling the
        iteration aborts the request and frees its KV in both services."""
        self.validate(req)
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[req.rid], self.requests[req.rid] = stream, req
        self.waiting.put_nowait(req)
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
                req.abort()
                await self.finish(req)
            self.streams.pop(req.rid, None)
            self.requests.pop(req.rid, None)

    def push(self, req: Request, item: Chunk | Exception) -> None:
        stream = self.streams.get(req.rid)
        if stream is not None and (
            not isinstance(item, Chunk) or item.token_ids or item.finish_reason
        ):
            stream.put_nowait(item)

    def fail(self, req: Request, error: Exception) -> None:
        req.abort()
        self.push(req, error)

    def requeue(self, req: Request) -> None:
        """Send a request whose target died back to admission: it is re-placed and replayed."""
        self.unplace(req)
        req.phase, req.worker = Phase.WAITING, None
        self.waiting.put_nowait(req)

    # -- placement -----------------------------------------------------------------------------
    def place(self, req: Request) -> None:
        live = [t for t in self.targets if self.target_breakers[t.name].allows()]
        if not live:
            raise ServiceDownError("no target replica is available")
        req.target = min(live, key=lambda c: self.load[c.name])
        self.load[req.target.name] += 1
        ready = [d for d in self.drafts if self.breakers[d.name].allows()]
        req.draft = min(ready, key=lambda c: self.load[c.name]) if ready and req.speculate else None
        if req.draft is not None:
            self.load[req.draft.name] += 1

    def unplace(self, req: Request) -> tuple[TargetClient | None, DraftClient | None]:
        target, draft = req.target, req.draft
        if target is not None:
            self.load[target.name] -= 1
        if draft is not None:
            self.load[draft.name] -= 1
        req.target = req.draft = req.tree = None
        return target, draft

    async def finish(self, req: Request) -> None:
        """Release the request's state in both services (idempotent, failures ignored)."""
        target, draft = self.unplace(req)
        for client in (target, draft):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.release([req.rid])

    # -- workers -------------------------------------------------------------------------------
    async def _worker(self, index: int) -> None:
        running: list[Request] = []
        while True:
            new = self._admit(running, index)
            if new:
                await self._guarded(self.rounds.prefill, new)
                running.extend(r for r in new if self._owns(index, r))
            if not running:
                req = await self.waiting.get()
                self.waiting.put_nowait(req)  # re-queued: _admit takes it with its siblings
                continue
            await self._guarded(self.rounds.step, running)
            running[:] = [r for r in running if self._owns(index, r)]
            await self._resume_speculation(running)
            running[:] = [r for r in running if self._owns(index, r)]

    async def _resume_speculation(self, running: list[Request]) -> None:
        """Requests that continued without speculation after a draft failure get a draft back
        once one is proven healthy again (its breaker closed by a successful step): their draft
        state can only be rebuilt from target features of the whole context, so they are
        replayed like after a failover (nothing emitted is lost or repeated)."""
        if not any(b.failures == 0 for b in self.breakers.values()):
            return
        for r in running:
            remaining = r.params.max_new_tokens - r.num_generated
            lost_draft = r.speculate and r.draft is None and r.phase is Phase.RUNNING
            if lost_draft and remaining >= self.cfg.resume_min_remaining:
                await self.finish(r)
                self.requeue(r)

    @staticmethod
    def _owns(index: int, r: Request) -> bool:
        """Still this worker's: not finished and not sent back to the queue (and maybe picked up
        by another worker) by a failover or a full KV cache."""
        return not r.finished and r.phase is Phase.RUNNING and r.worker == index

    async def _guarded(self, fn, reqs: list[Request]) -> None:
        """A bug in one round fails that round's requests (INTERNAL), never the worker."""
        try:
            await fn(reqs)
        except Exception as e:
            log.exception("round failed for %d requests", len(reqs))
            for r in reqs:
                if not r.finished:
                    self.fail(r, SpecmeshError(f"internal error: {type(e).__name__}: {e}"))
                    await self.finish(r)

    def _admit(self, running: list[Request], index: int) -> list[Request]:
        new = []
        while len(running) + len(new) < self.cfg.max_batch_size and not self.waiting.empty():
            req = self.waiting.get_nowait()
            if req.finished:
                continue
            try:
                self.place(req)
            except ServiceDownError as e:
                self.fail(req, e)
                continue
            req.phase, req.worker = Phase.RUNNING, index
            new.append(req)
        return new
