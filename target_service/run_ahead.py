"""Run-ahead decoding: the target computes a plain request's next decode step while the router
is still handling the step the target just answered.

A plain decode step's input is known to the target before the router sends it: the pending
token the target itself sampled. So once a batch of one-node trees is answered, the service
forwards those requests again at once (`run`) and keeps each one's decided token, path and
feature rows, without committing anything: the KV it wrote sits past the committed length,
where a verify's rejected nodes sit, and no request's state changes. When the router's next
verify names only such requests with their pending tokens as one-node trees (`take`), the
step is answered by committing what was decided: the forward left the critical path, and the
round costs the larger of the forward and the hop instead of their sum (what SGLang's overlap
scheduler does in one process, across the wire here). The rest of a batch (a request that just
joined, a drafted tree) runs as usual beside them; a decided step not asked for is dropped
(its KV is overwritten).

Lossless by construction: a decided step is exactly the step the router asks for, computed on
the same state, and the router's choice to ask for it never depends on the token it decided.
An entry is used only while its request is the same object, at the same committed length and
output offset, and asked for with the same feature; a release drops it (`drop`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specmesh.protocol.features import Feature
from specmesh.protocol.steps import VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.target_service.state import TargetRequest
from specmesh.target_service.verify import Decided, decide, verify_rows

if TYPE_CHECKING:
    from specmesh.target_service.runtime import TargetRuntime

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    request: TargetRequest  # identity: a request released and started again is another object
    committed_len: int
    next_offset: int
    feature: Feature
    decided: Decided


class RunAhead:
    """The decided next steps of plain requests, by request id (one runtime's)."""

    def __init__(self) -> None:
        self.ready: dict[str, _Ahead] = {}
        self.num_runs = 0  # requests run ahead
        self.num_hits = 0  # of which answered a verify

    def run(self, rt: TargetRuntime, rids: list[str], feature: Feature) -> None:
        """Decide the next plain decode step of each request of ``rids`` the runtime still
        holds. A request that cannot run now (KV full, state gone) is left out; a forward that
        fails leaves nothing ready (the router's step then runs as usual and reports it)."""
        inputs = [
            VerifyInput(rid, DraftTree.chain([rt.requests[rid].pending]))
            for rid in rids
            if rid in rt.requests
        ]
        rows, _ = verify_rows(rt, inputs, lambda rid: None)
        if not rows:
            return
        try:
            decided, _ = decide(rt, rows, feature)
        except Exception:  # the router's step runs it again, and reports what fails
            log.debug("run-ahead forward failed", exc_info=True)
            return
        for d in decided:
            rid = d.row.rid
            req = rt.requests[rid]
            committed = rt.cache.get(rid).committed_len
            self.ready[rid] = _Ahead(req, committed, req.next_offset, feature, d)
        self.num_runs += len(decided)

    def take(
        self, rt: TargetRuntime, inputs: list[VerifyInput], feature: Feature
    ) -> dict[str, Decided]:
        """The decided steps answering some of ``inputs``, by request id: each such input is
        its request's pending token as a one-node tree, on the state it was decided on. Every
        input's entry is dropped (the others run as usual)."""
        hits = {}
        for inp in inputs:
            decided = self._valid(rt, inp, feature)
            if decided is not None:
                hits[inp.rid] = decided
            self.ready.pop(inp.rid, None)
        self.num_hits += len(hits)
        return hits

    def _valid(self, rt: TargetRuntime, inp: VerifyInput, feature: Feature) -> Decided | None:
        a = self.ready.get(inp.rid)
        req = rt.requests.get(inp.rid)
        if a is None or req is not a.request or a.feature is not feature:
            return None
        if inp.tree.num_nodes != 1 or inp.tree.tokens[0] != req.pending:
            return None
        same = rt.cache.get(inp.rid).committed_len == a.committed_len
        return a.decided if same and req.next_offset == a.next_offset else None

    def drop(self, rid: str) -> None:
        self.ready.pop(rid, None)
