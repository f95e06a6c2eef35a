"""What one target step takes and returns, in process and on either side of the wire: the
inputs of prefill (whole, or one piece of a long input) and verify per request, and a step's
per-request output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.tree import Tree

if TYPE_CHECKING:
    from specmesh.rpc.rows import RowBlock


@dataclass
class PrefillInput:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    sample_offset: int = 0  # tokens already generated (a replay after failover)
    input_embeds: torch.Tensor | None = None  # [len(input_ids), hidden], merged multimodal embeds
    images: list[bytes] = field(default_factory=list)  # encoded images, for a multimodal target
    # Prefill in pieces (`specmesh.target_service.prefill_pieces`): where input_ids start in the
    # request's whole input (0: the first or only piece), and whether more pieces follow (then
    # the target extends its KV over them and samples nothing).
    input_start: int = 0
    more_input: bool = False


@dataclass
class VerifyInput:
    """Verify one tree; the request's sampling parameters and offset are the target's (sent at
    prefill)."""

    rid: str
    tree: Tree


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target's processed distribution, with the top
    alternatives asked for (the router's `TokenLogprob` has the same fields)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most probable first


def pick_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[Logprob]:
    """Row i of ``logprobs`` ``[rows, vocab]`` is the distribution ``tokens[i]`` was drawn
    from: its log-probability and the ``num_top`` most probable alternatives."""
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    top = logprobs.topk(num_top, -1) if num_top else None
    top_vals, top_ids = (top.values.tolist(), top.indices.tolist()) if top else ([], [])
    return [
        Logprob(t, lp, tuple(zip(top_ids[i], top_vals[i], strict=True)) if num_top else ())
        for i, (t, lp) in enumerate(zip(tokens, chosen.tolist(), strict=True))
    ]


@dataclass
class StepOutput:
    """Per-request tokens plus per-row features, rows grouped request by request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)  # [] for a piece before the last
    # Rows: torch tensors in process; in the gRPC router the target's bytes (`rpc.rows.RowBlock`),
    # never decoded there. Both slice as rows[start:stop].
    features: torch.Tensor | RowBlock | None = None  # [sum row_counts, feature_dim]
    mm_input_embeds: torch.Tensor | RowBlock | None = None  # [sum row_counts, hidden], prefill
    # Prefill of a multimodal request: the ids actually run (image placeholders expanded), set
    # only where expansion changed them. Row counts and the draft's committed ids follow these.
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)
    row_counts: dict[str, int] = field(default_factory=dict)
    # Requests that asked (SamplingParams.logprobs): one per entry of ``tokens``.
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    # Prefill of requests that asked (prompt_logprobs): one per prompt token after the first
    # (with the last piece of an input prefilled in pieces, for every piece).
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    errors: dict[str, SpecmeshError] = field(default_factory=dict)

    @staticmethod
    def merge(parts: list[StepOutput]) -> StepOutput:
        """One output from the outputs of consecutive sub-batches, rows kept in order."""
        cat = lambda ts: None if any(t is None for t in ts) or not ts else torch.cat(ts)
        out = StepOutput(
            features=cat([p.features for p in parts if p.tokens]),
            mm_input_embeds=cat([p.mm_input_embeds for p in parts if p.tokens]),
        )
        for p in parts:
            out.tokens.update(p.tokens)
            out.prompt_ids.update(p.prompt_ids)
            out.row_counts.update(p.row_counts)
            out.logprobs.update(p.logprobs)
            out.prompt_logprobs.update(p.prompt_logprobs)
            out.errors.update(p.errors)
        return out
