"""A random ragged batch over a paged KV pool, for the attention kernel tests
(`test_kernels_attention.py`, `test_kernels_mla_attention.py`)."""

from __future__ import annotations

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
