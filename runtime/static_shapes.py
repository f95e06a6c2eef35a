"""Static shapes: every buffer a static-shape runner (CUDA graphs, or the same path eagerly
on CPU) needs, sized in one place (DESIGN.md §4, invariant 5), and the padding of a ragged batch
to a captured size.

Sizes. A static-shape runner replays batches of ``bs`` requests with exactly ``tokens_per_req``
query rows each:

    mode            tokens_per_req     mask     kv per request (upper bound)
    target decode   1                  causal   max_context
    target verify   num_draft_tokens   tree     max_context
    draft step      topk               tree     DraftSizes.max_kv_per_req
    draft extend    num_steps + 1      causal   max_context

Its kv-indices buffer holds ``max_bs * max_kv_per_req`` slot ids and its mask buffer every query
row against its request's kv, ``max_bs * tokens_per_req * max_kv_per_req`` entries: the upper
bounds, so no size is ever read from the host (``seq_lens_sum`` may be unknown, invariant 3).
Draft decode with ``topk > 1`` packs ``topk`` frontier nodes per request into one batch: each
step ``j`` (1 .. num_steps - 1) forwards ``topk`` query rows per request, whose keys are the
request's committed prefix plus the speculative nodes written so far (``topk`` per earlier step)
plus themselves; the eager draft path and its static-shape runners size their buffers with
`DraftSizes`. `GraphSizes.check` and `DraftSizes.check_kv_entries` verify at run time that a
batch fits, with a message naming the numbers. `GraphBuffers` are the buffers themselves
(layout: the module docstring of `specmesh.runtime.graph_runner`), allocated once.

Padding. A runner replays a graph captured for ``num_tokens`` rows, so a batch of
``raw_num_tokens`` rows is padded with dummy rows. The contract, invariant 2 of DESIGN.md (seed
001: SGLang once returned ``mm_input_embeds`` of the padded size):

    items   = pad_batch(items, bucket_size(raw, buckets))   dummy rows go LAST, in their own
                                                            request, so real rows never see them
    out     = <replay / forward>(items)                     [num_tokens, ...] in every field
    out     = unpad(out, raw)                               [raw, ...] in EVERY tensor field

`unpad` is one generic call on the output type (``select`` slices each tensor field), so a field
added later cannot be forgotten. A graph runner must call it on every output it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, TypeVar

import torch

from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, ForwardModel, run_batch


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


@dataclass
class GraphBuffers:
    """Everything a captured forward reads, allocated once at the sizes' upper bounds."""

    # [2 * max_num_tokens + 2 * (max_bs + 1)] int64: input_ids, positions, kv_indptr and
    # mask_indptr, in that order (the fields below are views of it), so a runner writes all four
    # from the host in one copy
    header: torch.Tensor
    input_ids: torch.Tensor  # [max_num_tokens] int64
    positions: torch.Tensor  # [max_num_tokens] int64
    out_slots: torch.Tensor  # [max_num_tokens] int64, where each row's K/V is written
    qo_indptr: torch.Tensor  # [max_bs + 1] int64, constant: q rows per request
    kv_indptr: torch.Tensor  # [max_bs + 1] int64
    kv_indices: torch.Tensor  # [kv_indices_capacity] int64
    custom_mask: torch.Tensor | None  # [mask_capacity] bool, tree modes only
    mask_indptr: torch.Tensor | None  # [max_bs + 1] int64, tree modes only
    hidden_in: torch.Tensor | None  # [max_num_tokens, hidden], draft networks only
    pad_rows: torch.Tensor  # [max_bs] int64: q * (1 .. max_bs), indptr steps of padding requests
    pad_mask: torch.Tensor | None  # [max_bs * q * q] bool: lower-triangular [q, q] per request

    @staticmethod
    def allocate(
        sizes: GraphSizes,
        device: torch.device,
        pad_slot: int,
        hidden_in: tuple[int, torch.dtype] | None = None,  # (hidden size, dtype)
    ) -> GraphBuffers:
        n, q, bs = sizes.max_num_tokens, sizes.tokens_per_req, sizes.max_bs
        ints = dict(dtype=torch.int64, device=device)
        tril = torch.ones(q, q, dtype=torch.bool, device=device).tril().flatten()
        header = torch.zeros(2 * n + 2 * (bs + 1), **ints)
        input_ids, positions, kv_indptr, mask_indptr = header.split([n, n, bs + 1, bs + 1])
        return GraphBuffers(
            header=header,
            input_ids=input_ids,
            positions=positions,
            out_slots=torch.full((n,), pad_slot, **ints),
            qo_indptr=torch.arange(0, (bs + 1) * q, q, **ints),
            kv_indptr=kv_indptr,
            kv_indices=torch.full((sizes.kv_indices_capacity,), pad_slot, **ints),
            custom_mask=torch.zeros(sizes.mask_capacity, dtype=torch.bool, device=device)
            if sizes.has_mask
            else None,
            mask_indptr=mask_indptr if sizes.has_mask else None,
            hidden_in=None
            if hidden_in is None
            else torch.zeros(n, hidden_in[0], dtype=hidden_in[1], device=device),
            pad_rows=torch.arange(1, bs + 1, **ints) * q,
            pad_mask=tril.repeat(bs) if sizes.has_mask else None,
        )

    def metadata(self, bs: int, q: int, kv_lens_cpu: list[int] | None) -> AttentionMetadata:
        """The bucket's metadata: fixed-shape views of the buffers (the same tensors every call,
        so a captured graph reads whatever was last filled in). CPU fields only when given."""
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            out_slots=self.out_slots[: bs * q],
            custom_mask=self.custom_mask,
            mask_indptr=None if self.mask_indptr is None else self.mask_indptr[: bs + 1],
            q_lens_cpu=None if kv_lens_cpu is None else [q] * bs,
            kv_lens_cpu=kv_lens_cpu,
            max_q_len=None if kv_lens_cpu is None else q,
            max_kv_len=None if kv_lens_cpu is None else max(kv_lens_cpu),
        )


PAD_RID = "__pad__"  # the dummy request that owns the padding rows' KV


class Selectable(Protocol):
    def select(self, index: torch.Tensor | slice) -> Selectable: ...


Output = TypeVar("Output", bound=Selectable)


def bucket_size(num_tokens: int, buckets: Sequence[int]) -> int:
    """The smallest captured size that holds ``num_tokens`` rows."""
    fits = [b for b in buckets if b >= num_tokens]
    if not fits:
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {max(buckets, default=0)}")
    return min(fits)


def pad_batch(items: list[BatchItem], num_tokens: int, pad_rid: str = PAD_RID) -> list[BatchItem]:
    """``items`` plus one dummy request of zero ids (and zero embeddings when the batch carries
    ``input_embeds``) filling the batch to ``num_tokens`` rows."""
    raw = sum(it.q_len for it in items)
    if num_tokens < raw:
        raise ValueError(f"cannot pad a batch of {raw} tokens down to {num_tokens}")
    if num_tokens == raw:
        return items
    n = num_tokens - raw
    ref = next((it.input_embeds for it in items if it.input_embeds is not None), None)
    embeds = None if ref is None else ref.new_zeros(n, ref.shape[-1])  # [n, hidden]
    ids = items[0].input_ids.new_zeros(n) if items else torch.zeros(n, dtype=torch.int64)
    return [*items, BatchItem(pad_rid, ids, 0, input_embeds=embeds)]


def unpad(out: Output, raw_num_tokens: int) -> Output:
    """Cut EVERY tensor field of ``out`` back to the first ``raw_num_tokens`` rows."""
    return out.select(slice(0, raw_num_tokens))  # type: ignore[return-value]


def run_padded(
    model: ForwardModel,
    cache: KVCache,
    backend: AttentionBackend,
    items: list[BatchItem],
    num_tokens: int,
) -> Selectable:
    """Reference static-shape forward: pad to ``num_tokens``, run, unpad. The dummy request's KV
    is taken for the call and freed after it (a graph runner keeps a scratch slot instead)."""
    raw = sum(it.q_len for it in items)
    cache.add(PAD_RID)
    try:
        out = run_batch(model, cache, backend, pad_batch(items, num_tokens))
    finally:
        cache.release(PAD_RID)
    return unpad(out, raw)
