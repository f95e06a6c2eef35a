"""Per-request speculative decoding figures in OpenAI responses, in vLLM's shape
(``--per-request-spec-decode-metrics summary|detailed``): a top-level ``metrics`` object holding
``speculative_decoding``, in a whole response and in a stream's final usage chunk. Off unless the
router's flag or the request's ``spec_decode_metrics`` field asks; ``null`` for a response of
several choices (``n > 1`` or a batch of prompts), as vLLM gives request-level figures for one
sequence only. Read off the request's record (`Request.accept_lens`, `Request.round_drafts`):

    mean_acceptance_length      1 + accepted / steps (1.0 without a step): tokens per step
    draft_acceptance_rate       accepted / num_draft_tokens (0.0 without drafts)
    acceptance_histogram        [j]: the steps that accepted exactly j draft tokens
    num_spec_steps              verify rounds that checked a draft tree (plain rounds are not)
    num_accepted_draft_tokens   draft tokens accepted, bonus tokens excluded
    num_draft_tokens            draft tree nodes verified, roots excluded
    num_spec_tokens             the draft's num_steps: the most one step can accept (vLLM's K)
    per_step_accepted, per_step_drafted   ("detailed") each step's two counts, in order

A tree is not vLLM's chain: a step verifies up to num_draft_tokens - 1 nodes but accepts one
path of at most num_steps, so ``draft_acceptance_rate`` reads lower than a chain's for the same
accepted length, and ``per_step_drafted`` shrinks where a tree was cut (the end of the context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specmesh.router.openai_views import Choice
    from specmesh.router.request import Request

LEVELS = ("none", "summary", "detailed")


def response_metrics(choices: list[Choice], level: str, num_spec_tokens: int) -> dict:
    """The response's ``{"metrics": ...}`` to merge in; empty at level ``none``."""
    if level == "none":
        return {}
    one = len(choices) == 1
    spec = request_figures(choices[0].req, level, num_spec_tokens) if one else None
    return {"metrics": {"speculative_decoding": spec}}


def request_figures(req: Request, level: str, num_spec_tokens: int) -> dict:
    steps = [(n - 1, d) for n, d in zip(req.accept_lens, req.round_drafts, strict=True) if d]
    accepted = [a for a, _ in steps]
    num_steps, num_accepted = len(steps), sum(accepted)
    num_draft_tokens = sum(d for _, d in steps)
    histogram = [0] * (max([num_spec_tokens, *accepted]) + 1)
    for a in accepted:
        histogram[a] += 1
    out = {
        "mean_acceptance_length": 1.0 + num_accepted / num_steps if num_steps else 1.0,
        "draft_acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": num_steps,
        "num_accepted_draft_tokens": num_accepted,
        "num_draft_tokens": num_draft_tokens,
        "num_spec_tokens": num_spec_tokens,
    }
    if level == "detailed":
        out["per_step_accepted"] = accepted
        out["per_step_drafted"] = [d for _, d in steps]
    return out
