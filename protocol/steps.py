"""What one step of each model service takes and returns, the same in process and on either side
of the wire (`specmesh.rpc` maps them to the protos one to one).

Rows (``features``, ``mm_input_embeds``) are per-token tensors in process and the target's
undecoded bytes (`specmesh.protocol.codec.RowBlock`) in the gRPC router; both slice as
``rows[start:stop]`` and join with `codec.join_rows`, so the round is written once for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.trees import DraftTree

Rows = Any  # [rows, width]: a torch tensor in process, a RowBlock on the router's wire path


# -- target --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetInfo:
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    # Requests it holds at once, so also its largest batch (``--max-requests``; GetInfo's
    # max_batch_size); 0 = no limit. The router never places more on it.
    max_requests: int = 0


@dataclass
class PrefillInput:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    sample_offset: int = 0  # tokens already generated (a replay after failover)
    # [len(input_ids), hidden] merged multimodal embeddings, set inside the target only.
    input_embeds: Any = None
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
    tree: DraftTree


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target's processed distribution, with the top
    alternatives asked for (``SamplingParams.logprobs`` / ``prompt_logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most probable first


@dataclass
class StepOutput:
    """Per-request tokens plus per-row features, rows grouped request by request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)  # [] for a piece before the last
    features: Rows | None = None  # [sum row_counts, feature_dim]
    mm_input_embeds: Rows | None = None  # [sum row_counts, hidden], prefill
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
    # Prefill: input tokens whose KV came from the target's prefix cache.
    cached_tokens: dict[str, int] = field(default_factory=dict)


# -- draft ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftInfo:
    """What the router needs to know about a draft: its kind, what it reads from the target,
    and its tree shape."""

    kind: str
    needs: FeatureSpec
    num_steps: int = 1
    topk: int = 1
    num_draft_tokens: int = 2
    max_requests: int = 0  # requests it holds at once, as `TargetInfo.max_requests`


@dataclass
class ExtendInput:
    """Advance one request over the tokens the target just committed. Ids travel unrotated; the
    drafter pairs feature row p with token p + 1 itself (`rotated_rows`)."""

    rid: str
    committed_ids: list[int]  # tokens the target just committed (prompt, or root + accepted)
    next_token: int  # the target's pending token: the root of the next tree
    features: Rows | None = None  # [len(committed_ids), feature_dim]
    mm_input_embeds: Rows | None = None  # [len(committed_ids), hidden]
    is_multimodal: bool = False  # the request has images: mm_input_embeds is mandatory on its start
    new: bool = False  # first extend of the request (creates its draft state)
    # A starting extend of a constrained request: the grammar its output follows (the draft
    # proposes only tokens it allows, `draft_service.grammar`), and where the output begins in
    # the request's ids, counted from this extend's first: ids before it (the prompt, image rows
    # expanded) are not the grammar's; a replay's context ends with output it emitted before.
    constraint: Constraint | None = None
    output_start: int = 0
    learn: bool = True  # False: the client kept the request out of the draft's online learning


@dataclass
class DraftStepResult:
    """Per request: the next tree, or the error that failed it (its draft state is then gone)."""

    trees: dict[str, DraftTree] = field(default_factory=dict)
    errors: dict[str, SpecmeshError] = field(default_factory=dict)
    predrafted: set[str] = field(default_factory=set)  # trees a pre-draft had ready (a hit)
    # The draft weights' version each tree was drafted with; empty unless the draft learns
    # online (`specmesh.draft_service.online`)
    versions: dict[str, int] = field(default_factory=dict)
