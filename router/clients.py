"""What the speculative loop needs from the model services.

The same scheduler and loop run against the in-process clients (`specmesh.router.in_process`:
the `Engine` API and ``specmesh generate --in-process``) and against the gRPC clients
(`specmesh.router.grpc_clients`); the in-process run is the baseline that measures what the
split costs. Both speak the same protocol: a handshake (`configure`), steps, and an in-order
`release` that never overtakes work already sent for the same requests.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.steps import (
    DraftInfo,
    DraftStepResult,
    ExtendInput,
    PrefillInput,
    StepOutput,
    TargetInfo,
    VerifyInput,
)


class TargetClient(Protocol):
    info: TargetInfo
    name: str
    # Whether the target runs apart from the router and the draft (its own process, over the
    # wire), so that work sent to it overlaps theirs. Then the round sends a plain request's
    # next decode step with `send_verify` before it emits the last one (`specmesh.router.round`)
    # and admission splits requests between the micro-batches (`RouterCore._share`).
    remote: bool

    async def configure(self, needs: FeatureSpec) -> None:
        """The handshake: what every later step returns per token (the drafts' needs)."""

    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        """Whole inputs, or pieces of long ones (`PrefillInput.input_start` / ``more_input``):
        a piece before the last returns its rows and no token."""

    async def verify(self, inputs: list[VerifyInput], rows: bool = True) -> StepOutput:
        """The trees' accepted paths and bonus tokens; with ``rows`` the feature rows the
        handshake named (without: none, when no draft reads them)."""

    async def send_verify(
        self, inputs: list[VerifyInput], rows: bool = True
    ) -> Awaitable[StepOutput]:
        """`verify`, sent now: in order before any step or release sent after it returns; the
        awaitable it returns gives the answer (and must be awaited)."""

    async def release(self, rids: list[str]) -> None:
        """Free the requests' state, after every step already sent for them."""


class DraftClient(Protocol):
    info: DraftInfo
    name: str

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult: ...
    async def release(self, rids: list[str]) -> None:
        """Free the requests' state, after every step already sent for them."""

    async def prepare(self, constraints: list[Constraint]) -> None:
        """Start compiling ``constraints`` that requests will bring with their starting extends
        (nothing is awaited; a draft that shares the target's compiles does nothing)."""
