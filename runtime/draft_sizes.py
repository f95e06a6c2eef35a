"""Every draft-decode buffer size in one place (DESIGN.md §4, invariant 5).

Draft decode with ``topk > 1`` packs ``topk`` frontier nodes per request into one batch. Each step
``j`` (1 .. num_steps - 1) forwards ``topk`` query rows per request; their keys are the request's
committed prefix plus the speculative nodes written so far (``topk`` per earlier step) plus
themselves. The eager path and any static-shape (CUDA-graph) path size their buffers with
`DraftSizes`, and `check_kv_entries` verifies at run time that a step fits, with a message that
names the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftSizes:
    max_bs: int
    topk: int
    num_steps: int
    max_context_len: int

    def __post_init__(self) -> None:
        for name in ("max_bs", "topk", "num_steps", "max_context_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @cached_property
    def spec_tokens_per_req(self) -> int:
        """Speculative KV slots a request writes per round: the pending row plus topk nodes per
        decode step."""
        return 1 + self.topk * (self.num_steps - 1)

    @property
    def max_query_rows(self) -> int:
        return self.max_bs * self.topk

    @cached_property
    def max_kv_per_req(self) -> int:
        return self.max_context_len + self.spec_tokens_per_req

    @cached_property
    def kv_indices_capacity(self) -> int:
        """Upper bound on kv entries one decode step reads: ``max_bs * max_kv_per_req``."""
        return self.max_bs * self.max_kv_per_req

    @cached_property
    def mask_capacity(self) -> int:
        """Upper bound on custom-mask entries one decode step needs: every one of the
        ``max_bs * topk`` query rows against its request's kv."""
        return self.max_bs * self.topk * self.max_kv_per_req

    @staticmethod
    def kv_entries(seq_lens_sum: int, bs: int, topk: int, step: int) -> int:
        """Kv entries step ``step`` (1-based) reads: each request's prefix once, plus the root row
        and ``topk`` nodes per step so far (this step's included)."""
        return seq_lens_sum + bs * (1 + topk * step)

    def check_kv_entries(self, seq_lens_sum: int, bs: int, step: int) -> None:
        """Raise unless step ``step`` of ``bs`` requests fits the buffers (called every step: the
        capacities are computed once)."""
        used_kv = seq_lens_sum + bs * (1 + self.topk * step)  # `kv_entries`
        used_mask = used_kv * self.topk
        if bs > self.max_bs or used_kv > self.kv_indices_capacity or used_mask > self.mask_capacity:
            raise ValueError(
                f"draft decode step {step}: bs={bs} (max {self.max_bs}), topk={self.topk}, "
                f"seq_lens_sum={seq_lens_sum} needs {used_kv} kv entries and {used_mask} mask "
                f"entries; buffers hold {self.kv_indices_capacity} and {self.mask_capacity} "
                f"(max_context_len={self.max_context_len}, num_steps={self.num_steps})"
            )
