"""KV index gathering: the flat ``kv_indices`` / ``kv_indptr`` an attention call reads.

Request b's kv slots are its cached prefix ``req_to_slot[rows[b], :prefix_lens[b]]`` followed by
its new tokens' slots ``new_slots[b, :new_lens[b]]``; ``kv_indptr`` is the running sum of
``prefix_lens + new_lens``.

Triton: one program per request copies its prefix, then its new slots, at offset
``kv_indptr[b]`` of a buffer sized ``max_total`` (default ``B * max_context``, the sync-free upper
bound, DESIGN.md §4 invariant 3). The buffer is checked against the needed total (one host read,
the same one that sizes the returned slice) before the launch, with a ValueError naming both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import pick_impl


def _kv_indptr(prefix_lens: torch.Tensor, new_lens: torch.Tensor) -> torch.Tensor:  # [B + 1]
    indptr = torch.zeros(prefix_lens.numel() + 1, dtype=torch.int64, device=prefix_lens.device)
    indptr[1:] = torch.cumsum(prefix_lens + new_lens, 0)
    return indptr


def gather_kv_indices_ref(
    req_to_slot: torch.Tensor,  # [R, max_context] int64
    rows: torch.Tensor,  # [B] int64, request rows of req_to_slot
    prefix_lens: torch.Tensor,  # [B] int64, cached tokens
    new_slots: torch.Tensor,  # [B, max_new] int64
    new_lens: torch.Tensor,  # [B] int64
    max_total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_indptr [B + 1], kv_indices [sum kv_len]
    parts = []
    for b in range(rows.numel()):
        parts.append(req_to_slot[rows[b], : int(prefix_lens[b])])
        parts.append(new_slots[b, : int(new_lens[b])])
    indices = torch.cat(parts) if parts else req_to_slot.new_empty(0)
    bound = rows.numel() * req_to_slot.shape[1] if max_total is None else max_total
    if indices.numel() > bound:
        raise ValueError(f"kv indices need {indices.numel()} entries, buffer holds {bound}")
    return _kv_indptr(prefix_lens, new_lens), indices


@triton.jit
def _gather_kernel(
    req_to_slot, rows, prefix_lens, new_slots, new_lens, indptr, out,
    stride_req, stride_new, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(indptr + b)
    prefix_len = tl.load(prefix_lens + b)
    src = req_to_slot + tl.load(rows + b) * stride_req
    for s in range(0, prefix_len, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        ok = offs < prefix_len
        tl.store(out + start + offs, tl.load(src + offs, mask=ok), mask=ok)
    new_len = tl.load(new_lens + b)
    for s in range(0, new_len, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        ok = offs < new_len
        tl.store(out + start + prefix_len + offs, tl.load(new_slots + b * stride_new + offs,
                 mask=ok), mask=ok)  # fmt: skip


def gather_kv_indices_triton(
    req_to_slot: torch.Tensor,  # [R, max_context] int64
    rows: torch.Tensor,  # [B] int64
    prefix_lens: torch.Tensor,  # [B] int64
    new_slots: torch.Tensor,  # [B, max_new] int64
    new_lens: torch.Tensor,  # [B] int64
    max_total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_indptr [B + 1], kv_indices [sum kv_len]
    batch, max_context = rows.numel(), req_to_slot.shape[1]
    req_to_slot, new_slots = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (req_to_slot, new_slots)
    )
    bound = batch * max_context if max_total is None else max_total
    indptr = _kv_indptr(prefix_lens, new_lens)
    total = int(indptr[-1])
    if total > bound:
        raise ValueError(f"kv indices need {total} entries, buffer holds {bound}")
    out = torch.empty(bound, dtype=torch.int64, device=req_to_slot.device)  # upper bound
    if batch:
        _gather_kernel[(batch,)](
            req_to_slot, rows, prefix_lens, new_slots, new_lens, indptr, out,
            req_to_slot.stride(0), new_slots.stride(0), BLOCK=128,
        )  # fmt: skip
    return indptr, out[:total]


def gather_kv_indices(
    req_to_slot: torch.Tensor,  # [R, max_context] int64
    rows: torch.Tensor,  # [B] int64
    prefix_lens: torch.Tensor,  # [B] int64
    new_slots: torch.Tensor,  # [B, max_new] int64
    new_lens: torch.Tensor,  # [B] int64
    max_total: int | None = None,
    impl: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_indptr [B + 1], kv_indices [sum kv_len]
    fn = pick_impl(impl, gather_kv_indices_ref, gather_kv_indices_triton)
    return fn(req_to_slot, rows, prefix_lens, new_slots, new_lens, max_total)
