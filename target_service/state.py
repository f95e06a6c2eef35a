"""What the target keeps per request between steps (its configuration: `protocol.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.sampling import TokenHistory


@dataclass
class TargetRequest:
    """What the target keeps per request between steps."""

    params: SamplingParams
    next_offset: int  # output index of the next sampled token (seeded sampling)
    pending: int  # the last sampled token, not yet in the KV cache
    # Tokens so far (pending included), kept only when the params' processors read them.
    history: TokenHistory | None = None
    # Constrained requests: the grammar matcher after every committed token, pending included
    # (`target_service.grammar`).
    grammar: Any = None
