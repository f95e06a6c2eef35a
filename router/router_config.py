"""`RouterConfig`: how the router schedules, speculates, fails over and places requests; shared by
the in-process `Engine` and the gRPC router (`specmesh.router.core`)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.router.faults import StepDeadline
from specmesh.router.policy import MODES as SPECULATION_MODES


@dataclass(frozen=True)
class RouterConfig:
    max_batch_size: int = 32  # requests per micro-batch
    num_micro_batches: int | None = None  # workers running rounds; None: `micro_batches`
    # Each micro-batch admits at most its share of the requests held (`_share`); None: on if remote
    balance_micro_batches: bool | None = None
    max_waiting: int = 4096  # queued requests before admission says RESOURCE_EXHAUSTED
    # A draft step slower than its deadline counts as a draft failure. The deadline adapts:
    # draft_deadline_factor x the p99 of the draft's recent steady steps, at least
    # draft_deadline_floor_s, at most draft_timeout_s (also the deadline until 16 steps ran);
    # a step over more rows than a steady one gets it scaled by the ratio (`StepDeadline`).
    draft_timeout_s: float = 10.0
    draft_deadline_floor_s: float = 0.5
    draft_deadline_factor: float = 4.0
    draft_cooldown_s: float = 5.0  # circuit breaker: how long a failed draft is left alone
    max_replays: int = 2  # target failovers per request before UNAVAILABLE
    target_cooldown_s: float = 10.0  # a failed target replica gets no new requests this long
    # A request that lost its draft is replayed onto one once a draft served a step again,
    # if at least this many of its tokens are still to come
    resume_min_remaining: int = 32
    # Per round and micro-batch (`specmesh.router.policy`): "adaptive" speculates, and with how
    # many tree nodes, only where measured costs and acceptance say it yields more tokens per
    # second; "always" verifies the draft's full trees every round; "never" decodes without the
    # draft. The servers' --speculation flag defaults to adaptive; this API default keeps the
    # draft's tree shape fixed, round after round.
    speculation: str = "always"
    # Chunked prefill (`specmesh.router.prefill_plan`): prompt tokens a micro-batch sends its
    # target per round, so a long prompt is prefilled over several rounds with the running
    # requests' rounds between them; 0 = every prompt in one piece.
    prefill_chunk_tokens: int = 512
    # Which target replica a request goes to (`specmesh.router.placement`): "cache-aware" (the
    # longest prefix it was sent, among replicas near the least load) or "least-loaded".
    placement: str = "cache-aware"
    # Pipelined plain decoding (`specmesh.router.round`): a request that decodes without a
    # draft gets its next step sent to the target before the router emits the last one, where
    # the target client says it pays (`TargetClient.remote`: over gRPC).
    pipeline_decode: bool = True
    # The model's name in GetInfo, /v1/models and the metrics (``--served-model-name``); None:
    # the target's (`RouterCore.served_model`).
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 0 (0 = off), got {self.prefill_chunk_tokens}"
            )
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"speculation must be one of {', '.join(SPECULATION_MODES)}, "
                f"got {self.speculation!r}"
            )

    def micro_batches(self, remote: bool) -> int:
        """As set, else 2 where a target is remote (the target verifies one micro-batch while
        the draft works on the other) and 1 in process: one device runs both there, and a second
        worker would take each arrival into a half-size batch of its own (bench_results/HISTORY.md)."""
        return self.num_micro_batches or (2 if remote else 1)

    def draft_deadline(self) -> StepDeadline:
        """A fresh step deadline for one draft replica."""
        return StepDeadline(
            self.draft_timeout_s, self.draft_deadline_floor_s, self.draft_deadline_factor
        )
