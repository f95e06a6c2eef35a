"""A request's slot: what the scheduler keeps to run it. The `Request` is what it runs (the
source of truth: prompt, emitted tokens, stop rules); the slot only says where and how far.

The core makes one slot per request when it arrives and keeps it until the client's side ends,
replays included. Its fields come in two lifetimes:

    the request's run     worker, speculate, acceptance: kept across replays
    one placement         placement, tree, prefill progress, draft state: they describe the
                          request's state in the replicas it is pinned to, so they start over
                          (`unplaced`) whenever it leaves them; nothing can then describe state
                          a replica no longer holds for it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.router.policy import Acceptance

if TYPE_CHECKING:
    import asyncio

    from specmesh.protocol.steps import ExtendInput, StepOutput, VerifyInput
    from specmesh.protocol.trees import DraftTree
    from specmesh.router.placement import Placement
    from specmesh.router.request import Request


@dataclass(eq=False)
class Ahead:
    """A plain decode step sent before the round that reads it (`specmesh.router.round`): its
    answer, and the one-node tree it verifies for each of its requests."""

    answer: asyncio.Task[StepOutput]
    trees: dict[str, VerifyInput]


@dataclass(eq=False)
class Slot:
    request: Request
    rid: str = field(init=False)
    # Off for good once a draft refused the request or speculation is "never"; until then a
    # request that lost its draft may get one back (`RouterCore._resume_speculation`).
    speculate: bool = field(init=False)
    worker: int | None = None  # the micro-batch worker running it; None while it waits
    acceptance: Acceptance = field(default_factory=Acceptance)  # the speculation policy's input
    # -- one placement ---------------------------------------------------------------------------
    placement: Placement | None = None  # pinned replicas (the `Balancer` changes them)
    tree: DraftTree | None = None  # the draft's next proposal; verified once, then gone
    # Chunked prefill (`specmesh.router.prefill_plan`): context tokens sent to its target so
    # far, and whether the target has them all (then it runs rounds).
    prefill_sent: int = 0
    prefilled: bool = False
    # Whether an extend created its state on ``placement.draft``: the next extend starts it
    # there (`ExtendInput.new`) until one did.
    on_draft: bool = False
    # Extends held back while the policy plans plain decoding (`draft_rows.with_backlog`).
    draft_backlog: list[ExtendInput] = field(default_factory=list)
    # Its next decode step, sent to the target before the last one was emitted (`Ahead`).
    ahead: Ahead | None = None

    def __post_init__(self) -> None:
        self.rid, self.speculate = self.request.rid, self.request.speculate

    def unplaced(self) -> Placement | None:
        """Forget every trace of the current placement (returned, to be released)."""
        placement, self.placement = self.placement, None
        self.ahead = None  # its answer is dropped: the release follows it on the same stream
        self.prefill_sent, self.prefilled = 0, False  # a replay prefills its context again
        self.draft_dropped()
        return placement

    def draft_dropped(self) -> None:
        """The request continues without its draft state (the draft lost it or never had it)."""
        self.tree, self.on_draft, self.draft_backlog = None, False, []
