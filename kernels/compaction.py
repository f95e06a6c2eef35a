"""Accepted-token compaction: flat row indices of every accepted tree node.

Verification runs over ``[B * N, ...]`` rows (N tree nodes per request); the accepted path of
request b is ``accept_path[b, :accept_len[b]]``. ``flat_index`` lists ``b * N + node`` for each
accepted node, in path order, request by request, so ``hidden[flat_index]`` gathers the accepted
rows; ``cu_accept[b]:cu_accept[b+1]`` are request b's entries.

Triton: one program per request writes its path at offset ``cu_accept[b]`` of a buffer of the
upper-bound size ``B * N``. Returning the used slice needs the total on the host: pass
``num_accepted`` when the caller already knows it, else it is read from ``cu_accept[-1]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import next_pow2, pick_impl


def _cu_accept(accept_len: torch.Tensor) -> torch.Tensor:  # [B + 1] int64
    cu = torch.zeros(accept_len.numel() + 1, dtype=torch.int64, device=accept_len.device)
    cu[1:] = torch.cumsum(accept_len, 0)
    return cu


def compact_accepted_ref(
    accept_path: torch.Tensor,  # [B, N] int64, -1 padded
    accept_len: torch.Tensor,  # [B] int64
    num_accepted: int | None = None,  # sum(accept_len) when the caller knows it (unused here)
) -> tuple[torch.Tensor, torch.Tensor]:  # flat_index [sum accept_len], cu_accept [B + 1]
    n = accept_path.shape[1]
    parts = [b * n + accept_path[b, : int(length)] for b, length in enumerate(accept_len)]
    empty = accept_path.new_empty(0)
    return (torch.cat(parts) if parts else empty), _cu_accept(accept_len)


@triton.jit
def _compact_kernel(path, accept_len, cu, out, N, N_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_PAD)
    used = i < tl.load(accept_len + b)
    nodes = tl.load(path + b * N + i, mask=used, other=0)
    tl.store(out + tl.load(cu + b) + i, b * N + nodes, mask=used)


def compact_accepted_triton(
    accept_path: torch.Tensor,  # [B, N] int64
    accept_len: torch.Tensor,  # [B] int64
    num_accepted: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # flat_index [sum accept_len], cu_accept [B + 1]
    batch, n = accept_path.shape
    cu = _cu_accept(accept_len)
    out = torch.empty(batch * n, dtype=torch.int64, device=accept_path.device)  # upper bound
    if batch:
        _compact_kernel[(batch,)](accept_path.contiguous(), accept_len, cu, out, n,
                                  N_PAD=next_pow2(n))  # fmt: skip
    used = int(cu[-1]) if num_accepted is None else num_accepted
    return out[:used], cu


def compact_accepted(
    accept_path: torch.Tensor,  # [B, N] int64
    accept_len: torch.Tensor,  # [B] int64
    impl: str = "torch",
    num_accepted: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # flat_index [sum accept_len], cu_accept [B + 1]
    """``num_accepted`` (``sum(accept_len)``, known to a caller that read the lengths) spares
    the Triton path its read of the total: a device sync."""
    fn = pick_impl(impl, compact_accepted_ref, compact_accepted_triton)
    return fn(accept_path, accept_len, num_accepted)
