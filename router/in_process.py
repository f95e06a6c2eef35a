"""`TargetClient` / `DraftClient` that call the runtimes in this process.

With one micro-batch (the in-process default) a client runs each call on the event loop's own
thread, where it was made: nothing else waits on the loop meanwhile, and a round pays no thread
hand-offs (two per call; on CPU, where the model's host work and the router's Python share one
interpreter lock, running the draft beside the emit cost more than the overlap won: EAGLE-3
rounds of `bench.hop` in process 4.1 - 5.5 ms threaded against 3.6 - 3.9 ms inline). With
several micro-batches (``threaded``) each client runs its calls on one worker thread, in the
order they were made (as a service's Step stream does), so one micro-batch's host work
overlaps another's device work. Either way a release never overtakes the work it undoes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor

from specmesh.draft_service.runtime import DraftRuntime
from specmesh.protocol.constraints import Constraint
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.steps import (
    DraftStepResult,
    ExtendInput,
    PrefillInput,
    StepOutput,
    TargetInfo,
    VerifyInput,
)
from specmesh.target_service.runtime import TargetRuntime

INLINE_TURNS = 2  # loop turns before an inline call (`_Worker._submit`)


class _Worker:
    def __init__(self, name: str, threaded: bool) -> None:
        self.name = name
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None

    async def _call(self, fn, *args):
        return await (await self._submit(fn, *args))

    async def _submit(self, fn, *args) -> asyncio.Future:
        """``fn(*args)``: queued on the worker thread, or run now (inline) as a done future,
        after two turns of the loop: the loop's other tasks run between two model calls as they
        would while a thread worked (arrivals, cancels), and so do those the first turn woke
        (a stream's reader gets the tokens just emitted before the call holds the loop)."""
        loop = asyncio.get_running_loop()
        if self._worker is not None:
            return loop.run_in_executor(self._worker, fn, *args)
        for _ in range(INLINE_TURNS):
            await asyncio.sleep(0)
        done = loop.create_future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # raised where the caller awaits, as from the worker
            done.set_exception(e)
        return done


class InProcessTarget(_Worker):
    remote = False  # see `TargetClient.remote`; measured in bench/hop.py and bench --pin

    def __init__(
        self, runtime: TargetRuntime, name: str = "target-0", *, threaded: bool = False
    ) -> None:
        super().__init__(name, threaded)
        self.runtime = runtime
        mc = runtime.model_config
        self.info = TargetInfo(
            runtime.cfg.model_dir,
            mc.vocab_size,
            runtime.cfg.max_context,
            mc.eos_token_ids,
            mc.hidden_size,
            runtime.cfg.max_requests,
        )
        self.feature = Feature.NONE

    async def configure(self, needs: FeatureSpec) -> None:
        await self._call(self.runtime.configure, needs)
        self.feature = needs.feature

    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        return await self._call(self.runtime.prefill, inputs, self.feature)

    async def verify(self, inputs: list[VerifyInput], rows: bool = True) -> StepOutput:
        return await (await self.send_verify(inputs, rows))

    async def send_verify(
        self, inputs: list[VerifyInput], rows: bool = True
    ) -> Awaitable[StepOutput]:
        """`verify`, queued on the worker now (before anything called later), or run now."""
        feature = self.feature if rows else Feature.NONE
        return await self._submit(self.runtime.verify, inputs, feature)

    async def release(self, rids: list[str]) -> None:
        await self._call(lambda: [self.runtime.release(r) for r in rids])


class InProcessDraft(_Worker):
    def __init__(
        self, runtime: DraftRuntime, name: str = "draft-0", *, threaded: bool = False
    ) -> None:
        super().__init__(name, threaded)
        self.runtime, self.info = runtime, runtime.info()

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        """The runtime's step, then what it left for after the answer (a pre-draft): in process
        the draft shares the target's device, so the two run one after the other."""
        if self.runtime.ahead is None:  # no pre-drafting: nothing is left for after
            return await self._call(self.runtime.step, extends, propose)

        def run() -> DraftStepResult:
            result = self.runtime.step(extends, propose)
            self.runtime.after_step()
            return result

        return await self._call(run)

    async def release(self, rids: list[str]) -> None:
        await self._call(lambda: [self.runtime.release(r) for r in rids])

    async def prepare(self, constraints: list[Constraint]) -> None:
        """Nothing: in process the draft shares the target's compiles (`share_grammars`)."""
