"""Feature rows on their way from the target to the draft: cut per request out of a step's
output, and the extends a request holds back while the policy plans plain decoding, joined into
one when it speculates again. Rows are tensor slices in process and the target's bytes in the
gRPC router (`specmesh.protocol.codec`): the router never decodes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from specmesh.protocol.codec import RowBlock, join_rows
from specmesh.protocol.steps import ExtendInput, StepOutput
from specmesh.router.request import Request

if TYPE_CHECKING:
    import torch

# Feature rows of one request: a tensor slice in process, the target's bytes over gRPC.
Rows = Union["torch.Tensor", RowBlock]
# A request not speculating holds its draft extends back up to this many rows, then sends them
# (without a proposal) to keep the router's memory bounded.
MAX_BACKLOG_ROWS = 64


def split_rows(out: StepOutput) -> dict[str, tuple[Rows | None, Rows | None]]:
    """Cut the batch's feature rows (and multimodal embeddings) back into per-request rows
    (tensors in process, the target's bytes in the gRPC router: `protocol.codec`); rows follow the
    order of ``out.row_counts`` (the batch's order)."""
    rows, start = {}, 0
    for rid, n in out.row_counts.items():
        cut = lambda t: None if t is None else t[start : start + n]  # noqa: B023
        rows[rid] = (cut(out.features), cut(out.mm_input_embeds))
        start += n
    return rows


def held_back(r: Request, extend: ExtendInput) -> ExtendInput:
    """``extend`` preceded by the extends ``r`` held back while not speculating, as one extend
    (their ids and rows in order; the root is the newest pending token; it starts the draft
    state when the first did). A starting extend replaces them: the state they were for is
    gone. A multimodal start is never held (its embeddings come with its prompt only)."""
    held, r.draft_backlog = r.draft_backlog, []
    parts = [extend] if extend.new else [*held, extend]
    if len(parts) == 1:
        return extend
    return ExtendInput(
        r.rid,
        [t for p in parts for t in p.committed_ids],
        extend.next_token,
        join_rows([p.features for p in parts]),
        None,
        parts[0].is_multimodal,
        new=parts[0].new,
    )
