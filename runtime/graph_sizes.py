"""Every static-buffer size of a graph runner in one place (DESIGN.md §4, invariant 5).

A static-shape runner (CUDA graphs, or the same path run eagerly) replays batches of ``bs``
requests with exactly ``tokens_per_req`` query rows each:

    mode            tokens_per_req     mask     kv per request (upper bound)
    target decode   1                  causal   max_context
    target verify   num_draft_tokens   tree     max_context
    draft step      topk               tree     DraftSizes.max_kv_per_req
    draft extend    num_steps + 1      causal   max_context

Its kv-indices buffer holds ``max_bs * max_kv_per_req`` slot ids and its mask buffer every query
row against its request's kv, ``max_bs * tokens_per_req * max_kv_per_req`` entries: the upper
bounds, so no size is ever read from the host (``seq_lens_sum`` may be unknown, invariant 3).
The draft sizes come from `DraftSizes`, the same function the eager draft path checks against.
`GraphSizes.check` verifies at run time that a batch fits, with a message naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.runtime.draft_sizes import DraftSizes


@dataclass(frozen=True)
class GraphSizes:
    mode: str  # "decode" | "verify" | "draft-step": names the runner in error messages
    max_bs: int
    tokens_per_req: int  # query rows of every request of a batch
    max_kv_per_req: int
    has_mask: bool  # tree mask (custom_mask) rather than causal
    kv_indices_capacity: int
    mask_capacity: int  # 0 without a mask

    def __post_init__(self) -> None:
        for name in ("max_bs", "tokens_per_req", "max_kv_per_req"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{self.mode} graph: {name} must be >= 1, got {getattr(self, name)}"
                )

    @property
    def max_num_tokens(self) -> int:
        return self.max_bs * self.tokens_per_req

    def check(self, bs: int, kv_entries: int, mask_entries: int) -> None:
        """A padded batch of ``bs`` requests needing ``kv_entries`` kv slots and
        ``mask_entries`` mask entries fits the buffers, or a ValueError names the numbers."""
        if (
            bs > self.max_bs
            or kv_entries > self.kv_indices_capacity
            or mask_entries > self.mask_capacity
        ):
            raise ValueError(
                f"{self.mode} graph: bs={bs} (max {self.max_bs}), tokens_per_req="
                f"{self.tokens_per_req} needs {kv_entries} kv entries and {mask_entries} mask "
                f"entries; buffers hold {self.kv_indices_capacity} and {self.mask_capacity} "
                f"(max_kv_per_req={self.max_kv_per_req})"
            )


def _sizes(mode: str, max_bs: int, tokens: int, max_kv: int, has_mask: bool) -> GraphSizes:
    return GraphSizes(
        mode, max_bs, tokens, max_kv, has_mask,
        kv_indices_capacity=max_bs * max_kv,
        mask_capacity=max_bs * tokens * max_kv if has_mask else 0,
    )  # fmt: skip


def decode_sizes(max_bs: int, max_context: int) -> GraphSizes:
    """Target decode: one causal query row per request."""
    return _sizes("decode", max_bs, 1, max_context, has_mask=False)


def verify_sizes(max_bs: int, num_draft_tokens: int, max_context: int) -> GraphSizes:
    """Target verify: ``num_draft_tokens`` tree rows per request, prefix + tree within
    ``max_context`` (the KV cache refuses more)."""
    return _sizes("verify", max_bs, num_draft_tokens, max_context, has_mask=True)


def draft_step_sizes(draft: DraftSizes) -> GraphSizes:
    """Draft decode step: ``topk`` tree rows per request; the capacities are `DraftSizes`'."""
    return GraphSizes(
        "draft-step", draft.max_bs, draft.topk, draft.max_kv_per_req, True,
        kv_indices_capacity=draft.kv_indices_capacity, mask_capacity=draft.mask_capacity,
    )  # fmt: skip


def draft_extend_sizes(max_bs: int, width: int, max_context: int) -> GraphSizes:
    """Draft extend after a verify: ``width = num_steps + 1`` causal rows per request (the
    accepted tokens, then filler rows), prefix + rows within ``max_context``."""
    return _sizes("draft-extend", max_bs, width, max_context, has_mask=False)
