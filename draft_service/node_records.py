"""What a draft search records of its forwarded nodes when asked (``record``): where each
node's KV is, what it outputs and its children's candidates, keyed by its tokens below the
root. Pre-drafting (`specmesh.draft_service.predraft`) grows trees from these records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specmesh.draft_service.drafter import RootState


@dataclass
class NodeRecord:
    """A forwarded tree node, as pre-drafting reads it: where its KV is, what it outputs."""

    kv: int | None  # KV token index of its row; None for the root (in the prefix)
    ancestors: list[int]  # KV token indices of its forwarded ancestors, root excluded
    position: int
    hidden: torch.Tensor  # [hidden] its output: the input hidden of its children
    cand_ids: list[int]  # its children's most likely tokens (target ids), best first
    cand_logp: list[float]
    score: float  # cumulative log-probability of the path from the root to it


Records = dict[tuple[int, ...], NodeRecord]  # a node's tokens below the root -> the node
EXTRA_CANDIDATES = 2  # next tokens recorded per node beyond its topk children


def root_record(st: RootState, cand_ids: torch.Tensor, cand_logp: torch.Tensor) -> Records:
    """The root's record: its row is the prefix's last, its children's candidates given."""
    rec = NodeRecord(None, [], st.last_pos, st.hidden, cand_ids.tolist(), cand_logp.tolist(), 0.0)
    return {(): rec}


def record_frontier(records, step, k, states, fr, hidden, cands) -> None:
    """Each request's frontier nodes just forwarded at ``step`` (``fr``, the search's frontier),
    into its records."""
    cand_ids, cand_logp = cands
    scores, seen = fr.scores.tolist(), fr.seen.tolist()
    for b, rec in enumerate(records):
        st = states[b]
        start = st.spec_base + (step - 1) * k
        for i, path in enumerate(fr.paths[b]):
            ancestors = [st.spec_base + c for c, on in enumerate(seen[b][i]) if on]
            rec[path] = NodeRecord(
                start + i, ancestors, st.last_pos + step, hidden[b, i],
                cand_ids[b][i], cand_logp[b][i], scores[b][i],
            )  # fmt: skip
