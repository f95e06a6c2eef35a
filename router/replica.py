"""One connection to a model service replica, and what the router keeps for it.

A `Replica` owns its client, its circuit breaker, its load (the requests pinned to it, counted by
the `Balancer`) and the hooks its calls feed: latency metrics, and the speculation policy's cost
measurements (`SpeculationPolicy.service_time`, ``observe_*``). A draft replica also owns its
step deadline. Every step the round sends goes through one, so the round never touches a
breaker, a deadline or a metric; it only acts on what a call gives back:

    target step   a `StepOutput`, whose per-request errors say what to do (`Preempted`: wait and
                  replay; anything else: fail the request); or it raises `ServiceDownError` (its
                  breaker is open now: replay the requests elsewhere) or another `SpecmeshError`
                  (fail them)
    draft step    a `DraftStepResult`, or None: the step failed or missed its deadline (breaker
                  open, failure counted): continue without speculation
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, TypeVar

from specmesh.protocol.errors import KVCacheFullError, ServiceDownError
from specmesh.router.clients import DraftClient, TargetClient
from specmesh.router.faults import CircuitBreaker, StepDeadline

if TYPE_CHECKING:
    from specmesh.protocol.steps import (
        DraftInfo,
        DraftStepResult,
        ExtendInput,
        PrefillInput,
        StepOutput,
        VerifyInput,
    )
    from specmesh.router.metrics import RouterMetrics
    from specmesh.router.policy import Plan, SpeculationPolicy

log = logging.getLogger(__name__)
Answer = TypeVar("Answer")


class Preempted(KVCacheFullError):
    """The target dropped the request for lack of KV space that other requests held: it waits
    in the queue and is replayed (context + emitted tokens) once space frees up."""


class Replica:
    def __init__(
        self,
        client: TargetClient | DraftClient,
        cooldown_s: float,
        policy: SpeculationPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self.client, self.name = client, client.name
        self.breaker = CircuitBreaker(cooldown_s)
        self.load = 0  # requests pinned here (`Balancer`): every one that may hold state here
        self.policy, self.metrics = policy, metrics

    @property
    def live(self) -> bool:
        """Its breaker lets requests be placed here."""
        return self.breaker.allows()

    @property
    def has_room(self) -> bool:
        """Another request fits: the service holds at most the requests its handshake advertised
        (``max_requests``; 0: no limit), and every pinned request may hold state here."""
        limit = self.client.info.max_requests
        return not limit or self.load < limit

    async def release(self, rids: list[str]) -> None:
        """Free the requests' state, in-band: after every step already sent for them."""
        await self.client.release(rids)


class TargetReplica(Replica):
    client: TargetClient

    async def prefill(self, pieces: list[PrefillInput]) -> StepOutput:
        placed, started = self.load, time.monotonic()  # who may hold KV as the step is sent
        try:
            out = await self._answer(self.client.prefill(pieces))
        finally:  # a failed prefill held the replica too
            if self.policy.measures:
                self.policy.service_time(self.name, started, time.monotonic())
        self.metrics.on_prefill(self.name, time.monotonic() - started)
        return _mark_preempted(out, placed)

    async def verify(self, trees: list[VerifyInput], rows: bool = True) -> StepOutput:
        """``rows``: return the feature rows (`TargetClient.verify`)."""
        placed, started = self.load, time.monotonic()  # who may hold KV as the step is sent
        return await self._verified(self.client.verify(trees, rows), trees, placed, started)

    async def send_verify(
        self, trees: list[VerifyInput], rows: bool = True
    ) -> Awaitable[StepOutput]:
        """`verify`, sent now (in order before any step or release sent later); await what it
        returns for the answer. Raises `ServiceDownError` when it cannot be sent."""
        placed, started = self.load, time.monotonic()  # who may hold KV as the step is sent
        answer = await self._answer(self.client.send_verify(trees, rows))
        return self._verified(answer, trees, placed, started)

    async def _verified(
        self, answer: Awaitable[StepOutput], trees: list[VerifyInput], placed: int, started: float
    ) -> StepOutput:
        out = await self._answer(answer)
        ended = time.monotonic()
        self.metrics.on_verify(self.name, ended - started)
        if self.policy.measures:
            seconds = self.policy.service_time(self.name, started, ended)
            size = max(v.tree.num_nodes for v in trees)
            self.policy.observe_verify(self.name, len(trees), size, seconds)
        return _mark_preempted(out, placed)

    async def _answer(self, step: Awaitable[Answer]) -> Answer:
        try:
            return await step
        except ServiceDownError:
            self.breaker.record_failure()  # no new requests here for a cooldown
            raise


class DraftReplica(Replica):
    client: DraftClient

    def __init__(
        self,
        client: DraftClient,
        cooldown_s: float,
        policy: SpeculationPolicy,
        metrics: RouterMetrics,
        deadline: StepDeadline,
    ) -> None:
        super().__init__(client, cooldown_s, policy, metrics)
        self.deadline = deadline

    @property
    def info(self) -> DraftInfo:
        return self.client.info

    async def step(self, extends: list[ExtendInput], plan: Plan) -> DraftStepResult | None:
        """Extend, then propose when ``plan`` speculates; None when the step failed or missed
        its deadline (any failure only costs speculation, never a request)."""
        started = time.monotonic()
        # A steady step (what the policy's cost estimate and the deadline learn from): each
        # request extends over at most one round's tokens (no prompt, no rounds held back).
        rows, most = sum(len(e.committed_ids) for e in extends), self.info.num_draft_tokens
        steady = all(not e.new and len(e.committed_ids) <= most for e in extends)
        try:  # a timeout, not wait_for: no task
            async with asyncio.timeout(self.deadline.seconds_for(rows)):
                res = await self.client.step(extends, plan.speculate)
        except Exception as e:
            log.warning("draft %s failed (%s: %s); continuing without speculation",
                        self.name, type(e).__name__, e)  # fmt: skip
            self.breaker.record_failure()
            self.metrics.on_draft_failure(self.name)
            return None
        seconds = time.monotonic() - started
        self.breaker.record_success()
        if steady:  # what a step's latency is learned from; a prompt's extend is more work
            self.deadline.observe(seconds, rows)
        self.metrics.on_draft_step(self.name, seconds)
        if self.policy.measures:
            busy = self.policy.service_time(self.name, started, started + seconds)
            if plan.speculate and steady:
                self.policy.observe_draft(self.name, len(extends), busy)
        return res


def _mark_preempted(out: StepOutput, placed: int) -> StepOutput:
    """``out`` with each full-KV error marked `Preempted` when the requests that failed shared
    the cache with one that still held it: ``placed`` were pinned here when the step was sent,
    the failed ones among them, and the target dropped every failed one. Counted at send time,
    not when a failure is handled: by then the requests that finished in this step have left,
    and their KV was the pressure (a live count failed a request that only had to wait). A
    request that does not fit on its own keeps its error and fails."""
    if out.errors and placed > len(out.errors):
        out.errors = {
            rid: Preempted(str(e)) if isinstance(e, KVCacheFullError) else e
            for rid, e in out.errors.items()
        }
    return out


async def together(steps: Iterable[Awaitable[Answer]]) -> list[Answer]:
    """Several replicas' steps awaited at once (`asyncio.gather`), except that a lone step is
    awaited directly: no task, so the message it writes goes out in this turn of the event loop
    instead of a later one (a round is most often one micro-batch on one target and one draft)."""
    steps = list(steps)
    if len(steps) == 1:
        return [await steps[0]]
    return list(await asyncio.gather(*steps))
