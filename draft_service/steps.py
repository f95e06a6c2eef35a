"""What one draft step takes and returns, in process and on either side of the wire (the draft's
counterpart of `specmesh.target_service.steps`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.features import FeatureSpec
from specmesh.runtime.tree import Tree

if TYPE_CHECKING:
    from specmesh.rpc.rows import RowBlock


@dataclass
class ExtendInput:
    """Advance one request over the tokens the target just committed. Ids travel unrotated; the
    drafter pairs feature row p with token p + 1 itself (`rotated_rows`)."""

    rid: str
    committed_ids: list[int]  # tokens the target just committed (prompt, or root + accepted)
    next_token: int  # the target's pending token: the root of the next tree
    # Rows as the target sent them: torch tensors in process, `rpc.rows.RowBlock` bytes in the
    # gRPC router (written into the draft's request without decoding).
    features: torch.Tensor | RowBlock | None = None  # [len(committed_ids), feature_dim]
    mm_input_embeds: torch.Tensor | RowBlock | None = None  # [len(committed_ids), hidden]
    is_multimodal: bool = False  # the request has images: mm_input_embeds is mandatory on its start
    new: bool = False  # first extend of the request (creates its draft state)


@dataclass
class DraftStepResult:
    """Per request: the next tree, or the error that failed it (its draft state is then gone)."""

    trees: dict[str, Tree] = field(default_factory=dict)
    errors: dict[str, SpecmeshError] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftInfo:
    """What the router needs to know about a draft: its kind, what it reads from the target,
    and its tree shape."""

    kind: str
    needs: FeatureSpec
    num_steps: int = 1
    topk: int = 1
    num_draft_tokens: int = 2
