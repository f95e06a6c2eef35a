"""A random ragged batch over a paged KV pool, for the attention kernel tests
(`test_kernels_attention.py`, `test_kernels_mla_attention.py`)."""

from __future__ import annotations

import math

import torch

from specmesh.runtime.attention.base import AttentionMetadata


def paged_batch(
    lens: list[tuple[int, int]],  # (prefix_len, q_len) per request
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    tree_mask: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q / K / V pools and the metadata of a ragged batch over scattered slots; with
    ``tree_mask`` a custom mask (prefix visible, a random ancestor set including self)."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in lens]
    num_slots = sum(kv_lens) + 5
    slots = torch.randperm(num_slots, generator=gen)[: sum(kv_lens)]  # scattered pages
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(n for _, n in lens), heads, head_dim, generator=gen).to(dtype)
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()])
    kv_indptr = cum(kv_lens)
    out_slots = torch.cat([slots[kv_indptr[b + 1] - n : kv_indptr[b + 1]] for b, (_, n) in
                           enumerate(lens)])  # fmt: skip
    custom_mask = mask_indptr = None
    if tree_mask:
        masks = []
        for p, n in lens:
            tree = torch.rand(n, n, generator=gen) < 0.4
            tree = tree.tril() | torch.eye(n, dtype=torch.bool)
            masks.append(torch.cat([torch.ones(n, p, dtype=torch.bool), tree], 1).flatten())
        custom_mask = torch.cat(masks).to(device)
        mask_indptr = cum([p * n + n * n for p, n in lens]).to(device)
    meta = AttentionMetadata(
        qo_indptr=cum([n for _, n in lens]).to(device),
        kv_indptr=kv_indptr.to(device),
        kv_indices=slots.to(device),
        out_slots=out_slots.to(device),
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
    )
    return q.to(device), k_pool.to(device), v_pool.to(device), meta


def assert_close_to_fp64(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    multiple: float = 4.0,
    floor_ulps: float = 8.0,
) -> None:
    """An fp32 kernel's output against the same attention in float64: its error may be at most
    ``multiple`` times the fp32 torch reference's own error (the rounding that summing in another
    order costs on this machine and device), plus ``floor_ulps`` units in the last place at the
    output's scale, more for dot products wider than 64 (rounding grows with the square root
    of a sum's length: the DeepSeek-V3 widths, 576, on CUDA were 1.42e-5 off against a bound
    of 1.39e-5 without it). A tolerance set by one machine's run fails on another's rounding;
    a masking or indexing bug is off by orders of magnitude more than either term."""
    from specmesh.kernels.attention import paged_attention_ref

    exact = paged_attention_ref(q.double(), k_pool.double(), v_pool.double(), meta, scale)
    ref = paged_attention_ref(q, k_pool, v_pool, meta, scale)
    ref_err = (ref.double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    width = max(1.0, math.sqrt(q.shape[-1] / 64))
    floor = floor_ulps * width * torch.finfo(out.dtype).eps * exact.abs().max().item()
    bound = multiple * ref_err + floor
    assert err <= bound, (
        f"kernel off the fp64 attention by {err:.3g}, above {bound:.3g} "
        f"({multiple} x the fp32 reference's own {ref_err:.3g} + {floor:.3g})"
    )
