"""Feature rows on their way from the target to the draft: cut per request out of a step's
output, and the extends a request holds back while the policy plans plain decoding, joined into
one when it speculates again. Rows are tensor slices in process and the target's bytes in the
gRPC router (`specmesh.protocol.codec`): the router never decodes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from specmesh.protocol.codec import RowBlock, join_rows
from specmesh.protocol.steps import ExtendInput, StepOutput

if TYPE_CHECKING:
    import torch

    from specmesh.router.slot import Slot

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


def with_backlog(slot: Slot, extend: ExtendInput) -> ExtendInput:
    """``extend`` preceded by the extends ``slot`` held back while not speculating, as one extend
    (their ids and rows in order; the root is the newest pending token). It starts the request's
    draft state when no extend has yet (`Slot.on_draft`): the backlog only ever holds extends
    for the current placement (`Slot.unplaced`)."""
    parts, slot.draft_backlog = [*slot.draft_backlog, extend], []
    if len(parts) == 1:
        extend.new = not slot.on_draft
        return extend
    return ExtendInput(
        slot.rid,
        [t for p in parts for t in p.committed_ids],
        extend.next_token,
        join_rows([p.features for p in parts]),
        None,  # a multimodal start is never held: its embeddings come with its prompt only
        parts[0].is_multimodal,
        new=not slot.on_draft,
        constraint=parts[0].constraint,  # a starting extend's, counted from its first id
        output_start=parts[0].output_start,
        learn=extend.learn,
    )


def must_send(extend: ExtendInput) -> bool:
    """An extend that cannot wait for the next proposal: a multimodal start (its embeddings come
    with the prompt only) or a backlog at its bound."""
    return (extend.new and extend.is_multimodal) or len(extend.committed_ids) >= MAX_BACKLOG_ROWS
