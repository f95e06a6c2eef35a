"""Chunked prefill: which part of each new request's context a micro-batch sends this round.

A prompt longer than the round's token budget (``RouterConfig.prefill_chunk_tokens``) reaches
its target in pieces, one round at a time, and the micro-batch's running requests get a verify
round between two pieces: a long prompt delays them by at most one budget of prefill work,
never by the whole prompt. The target holds the partly prefilled request (its KV and sampling
state); the router only counts how far it sent (``Slot.prefill_sent``).

Budget, per round of one micro-batch: requests are served in admission order, each its next
piece, until the budget is spent; a short prompt behind a long one may share a round with the
long one's piece. A prompt with images goes in one piece whatever its length: the target expands
its image placeholders into vision rows when it merges the images, which needs the whole prompt.
"""

from __future__ import annotations

from dataclasses import replace

from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.router.request import Request
from specmesh.router.slot import Slot


def plan_pieces(slots: list[Slot], budget: int) -> dict[str, int]:
    """Context tokens each request sends this round (a request left out waits); ``budget`` 0
    sends every context whole."""
    sizes, left = {}, budget
    for s in slots:
        r = s.request
        if r.finished:
            continue
        if budget and left <= 0:
            break
        remaining = len(r.prompt_ids) + r.num_generated - s.prefill_sent
        sizes[r.rid] = n = remaining if not budget or r.images else min(remaining, left)
        left -= n
    return sizes


def prefill_piece(s: Slot, n: int) -> PrefillInput:
    """The next ``n`` tokens of the request's context, as the target's prefill input (the first
    piece carries the sampling state; the target keeps it for the later ones)."""
    r = s.request
    context, start = r.context_ids(), s.prefill_sent
    return PrefillInput(
        r.rid,
        context[start : start + n],
        prefill_params(r),
        r.num_generated,
        images=r.images,
        input_start=start,
        more_input=start + n < len(context),
    )


def next_context_token(s: Slot) -> int:
    """The context token after the pieces sent so far: the token the draft pairs with the last
    row of a piece (the next piece's first)."""
    return s.request.context_ids()[s.prefill_sent]


def prefill_params(r: Request) -> SamplingParams:
    """A request's params for a prefill: prompt logprobs only until they were sent (a replay
    after tokens were emitted, which came with them, does not ask again)."""
    if r.params.prompt_logprobs is None or r.num_generated == 0:
        return r.params
    return replace(r.params, prompt_logprobs=None)
