"""What the speculative loop needs from the model services, and the in-process implementation.

The same scheduler and loop run against `InProcessTarget` / `InProcessDraft` (the `Engine` API and
``specmesh generate --in-process``) and against the gRPC clients in `specmesh.router.grpc_clients`;
the in-process run is the baseline that measures what the split costs.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Protocol

from specmesh.draft_service.feature_drafter import ExtendInput
from specmesh.draft_service.runtime import DraftRuntime
from specmesh.runtime.tree import Tree
from specmesh.target_service.runtime import TargetRuntime
from specmesh.target_service.steps import PrefillInput, StepOutput, VerifyInput


@dataclass(frozen=True)
class TargetInfo:
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int


@dataclass(frozen=True)
class DraftInfo:
    kind: str
    feature: str  # what the draft needs from the target: "aux", "hidden", "hidden_pre_norm", "none"
    aux_layer_ids: tuple[int, ...] = ()
    aux_convention: str = "input"
    num_steps: int = 1
    topk: int = 1
    num_draft_tokens: int = 2


@dataclass
class DraftStepResult:
    trees: dict[str, Tree] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)


class TargetClient(Protocol):
    info: TargetInfo
    name: str

    async def configure(self, draft: DraftInfo | None) -> None: ...
    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput: ...
    async def verify(self, inputs: list[VerifyInput]) -> StepOutput: ...
    async def release(self, rids: list[str]) -> None: ...


class DraftClient(Protocol):
    info: DraftInfo
    name: str

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult: ...
    async def release(self, rids: list[str]) -> None: ...


class InProcessTarget:
    """Calls a `TargetRuntime` in a worker thread, so two micro-batches can overlap."""

    def __init__(self, runtime: TargetRuntime, name: str = "target-0") -> None:
        self.runtime, self.name = runtime, name
        mc = runtime.model_config
        self.info = TargetInfo(
            runtime.cfg.model_dir,
            mc.vocab_size,
            runtime.cfg.max_context,
            mc.eos_token_ids,
            mc.hidden_size,
        )
        self._lock = asyncio.Lock()  # one forward at a time, like a real service

    async def _call(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    async def configure(self, draft: DraftInfo | None) -> None:
        configure_target(self.runtime, draft)

    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        return await self._call(self.runtime.prefill, inputs)

    async def verify(self, inputs: list[VerifyInput]) -> StepOutput:
        return await self._call(self.runtime.verify, inputs)

    async def release(self, rids: list[str]) -> None:
        await self._call(_release_all, self.runtime, rids)


class InProcessDraft:
    def __init__(self, runtime: DraftRuntime, name: str = "draft-0") -> None:
        self.runtime, self.name, self.info = runtime, name, runtime.info()
        self._lock = asyncio.Lock()

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        async with self._lock:
            return await asyncio.to_thread(self.runtime.step, extends, propose)

    async def release(self, rids: list[str]) -> None:
        async with self._lock:
            await asyncio.to_thread(_release_all, self.runtime, rids)


def configure_target(runtime: TargetRuntime, draft: DraftInfo | None) -> None:
    """Make the target capture what the draft consumes (EAGLE-3: the draft's aux layer ids)."""
    if draft is None:
        runtime.set_feature("none")
        return
    if draft.feature == "aux" and draft.aux_layer_ids:
        from specmesh.runtime.models.causal_lm import AuxLayers

        runtime.set_aux_layers(AuxLayers(draft.aux_layer_ids, draft.aux_convention))
    runtime.set_feature(draft.feature)


def _release_all(runtime: TargetRuntime | DraftRuntime, rids: list[str]) -> None:
    for rid in rids:
        with contextlib.suppress(KeyError):  # already gone: release is idempotent
            runtime.release(rid)
