"""Tree building: rerank the drafting pool to the N-1 best candidates and lay out the tree.

Drafting runs S steps of top-k; the candidates (root excluded) form a pool of
``P = k + (S-1) * k * k`` entries per request with a cumulative path score, a token and the pool
index of the parent (-1 = the root); a parent's pool index is smaller than its child's.

Selection: the N-1 best entries by a STABLE descending sort of the scores, then ordered by
ascending pool index, the root prepended. Why every selected node's parent is selected:
``score(child) <= score(parent)`` and ``parent index < child index``, so the stable sort puts the
parent first; and ascending pool order puts the parent at a smaller tree index than the child.

Tree index layout (per request)::

    0      1 .. N-1
    root | selected pool entries in ascending pool index (parents before children)

Triton: the sort runs in torch (``torch.sort(stable=True)``); one program per request then maps
pool parents to tree parents, and derives depths, the ancestor mask (pointer jumping over the
parent vector held in registers) and the first-child / next-sibling links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import next_pow2, pick_impl


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64, root token first
    parents: torch.Tensor  # [B, N] int64, tree index of the parent, -1 for the root
    depths: torch.Tensor  # [B, N] int64, root 0
    first_child: torch.Tensor  # [B, N] int64, -1 if none
    next_sibling: torch.Tensor  # [B, N] int64, children in ascending tree index, -1 if none
    mask: torch.Tensor  # [B, N, N] bool, node i sees j iff j is i or an ancestor of i


def select_pool_entries(pool_scores: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Pool indices of the N-1 best entries, ascending: ``[B, N-1]`` int64."""
    pool_size = pool_scores.shape[1]
    if not 1 <= num_draft_tokens <= pool_size + 1:
        raise ValueError(
            f"num_draft_tokens {num_draft_tokens} needs {num_draft_tokens - 1} pool entries, "
            f"the pool holds {pool_size} (and at least the root is needed)"
        )
    order = torch.sort(pool_scores, dim=1, descending=True, stable=True).indices
    return order[:, : num_draft_tokens - 1].sort(dim=1).values  # [B, N-1]


def build_tree_ref(
    root_tokens: torch.Tensor,  # [B] int64
    pool_scores: torch.Tensor,  # [B, P] float32
    pool_tokens: torch.Tensor,  # [B, P] int64
    pool_parents: torch.Tensor,  # [B, P] int64, -1 = root
    num_draft_tokens: int,
) -> DraftTree:
    selected = select_pool_entries(pool_scores, num_draft_tokens)  # [B, N-1]
    batch, n = root_tokens.numel(), num_draft_tokens
    dev = root_tokens.device
    tree_of_pool = torch.full_like(pool_parents, -1)  # [B, P]
    tree_of_pool.scatter_(1, selected, torch.arange(1, n, device=dev).expand(batch, -1))
    parent_pool = pool_parents.gather(1, selected)  # [B, N-1]
    parent_tree = tree_of_pool.gather(1, parent_pool.clamp(min=0))
    if bool(((parent_pool >= 0) & (parent_tree < 0)).any()):
        raise ValueError("a selected pool entry's parent was not selected: scores must not grow")
    parents = torch.cat([torch.full((batch, 1), -1, device=dev), parent_tree.where(
        parent_pool >= 0, 0)], 1)  # fmt: skip

    links = [_tree_links(row) for row in parents.tolist()]  # host integers: one copy
    field = lambda f, dtype=torch.int64: torch.tensor([row[f] for row in links], dtype=dtype)
    depths, first_child, next_sibling = (field(f).to(dev).view(batch, n) for f in range(3))
    mask = field(3, torch.bool).to(dev).view(batch, n, n)
    tokens = torch.cat([root_tokens[:, None], pool_tokens.gather(1, selected)], 1)
    return DraftTree(tokens, parents, depths, first_child, next_sibling, mask)


def _tree_links(parents: list[int]) -> tuple[list[int], list[int], list[int], list[bool]]:
    """Depths, first children, next siblings and the flat ancestor mask ``[N * N]`` of one
    tree whose parents come before their children."""
    n = len(parents)
    depths, first_child, next_sibling, last_child = [0] * n, [-1] * n, [-1] * n, [-1] * n
    mask = [[j == i for j in range(n)] for i in range(n)]
    for i in range(1, n):
        p = parents[i]
        depths[i] = depths[p] + 1
        mask[i] = [a or b for a, b in zip(mask[i], mask[p], strict=True)]
        if last_child[p] < 0:
            first_child[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    return depths, first_child, next_sibling, [x for row in mask for x in row]


@triton.jit
def _tree_kernel(
    selected, root_tokens, pool_tokens, pool_parents,
    tokens, parents, depths, first_child, next_sibling, mask,
    N, P, N_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_PAD)  # tree index (rows)
    j = tl.arange(0, N_PAD)  # tree index (columns)
    valid = i < N
    drafted = valid & (i > 0)
    pool_idx = tl.load(selected + b * (N - 1) + i - 1, mask=drafted, other=-1)  # [N_PAD]
    token = tl.load(pool_tokens + b * P + pool_idx, mask=drafted, other=0)
    token = tl.where(i == 0, tl.load(root_tokens + b), token)
    parent_pool = tl.load(pool_parents + b * P + pool_idx, mask=drafted, other=-1)
    # Tree parent = column whose pool index equals the parent's pool index (0 = the root).
    same = (parent_pool[:, None] == pool_idx[None, :]) & drafted[None, :]  # [N_PAD, N_PAD]
    parent = tl.max(tl.where(same, j[None, :], 0), axis=1)
    parent = tl.where(drafted, parent, tl.where(i == 0, -1, -2))  # padding matches no one

    # Pointer jumping: anc walks up one level per step; i sees every node it passes.
    anc = i
    sees = j[None, :] == i[:, None]
    depth = tl.zeros((N_PAD,), tl.int64)
    for _ in range(1, N):
        anc = tl.max(tl.where(j[None, :] == anc[:, None], parent[None, :], -1), axis=1)
        sees = sees | (j[None, :] == anc[:, None])
        depth += (anc >= 0).to(tl.int64)

    is_child = parent[None, :] == i[:, None]  # [row p, col c]: c is a child of p
    first = tl.min(tl.where(is_child, j[None, :], N_PAD), axis=1)
    sibling = (parent[None, :] == parent[:, None]) & (j[None, :] > i[:, None]) & valid[None, :]
    nxt = tl.min(tl.where(sibling, j[None, :], N_PAD), axis=1)

    out = b * N + i
    tl.store(tokens + out, token, mask=valid)
    tl.store(parents + out, parent, mask=valid)
    tl.store(depths + out, depth, mask=valid)
    tl.store(first_child + out, tl.where(first < N_PAD, first, -1), mask=valid)
    tl.store(next_sibling + out, tl.where(nxt < N_PAD, nxt, -1), mask=valid)
    cell = b * N * N + i[:, None] * N + j[None, :]
    tl.store(mask + cell, sees.to(tl.uint8), mask=valid[:, None] & (j < N)[None, :])


def build_tree_triton(
    root_tokens: torch.Tensor,  # [B] int64
    pool_scores: torch.Tensor,  # [B, P] float32
    pool_tokens: torch.Tensor,  # [B, P] int64
    pool_parents: torch.Tensor,  # [B, P] int64
    num_draft_tokens: int,
) -> DraftTree:
    """Sort in torch, layout in Triton; unselected parents are not checked (sync-free)."""
    selected = select_pool_entries(pool_scores, num_draft_tokens).contiguous()  # [B, N-1]
    batch, n, dev = root_tokens.numel(), num_draft_tokens, root_tokens.device
    ints = [torch.empty(batch, n, dtype=torch.int64, device=dev) for _ in range(5)]  # [B, N]
    mask = torch.empty(batch, n, n, dtype=torch.uint8, device=dev)  # [B, N, N]
    if batch:
        _tree_kernel[(batch,)](
            selected, root_tokens, pool_tokens.contiguous(), pool_parents.contiguous(),
            *ints, mask, n, pool_tokens.shape[1], N_PAD=next_pow2(n),
        )  # fmt: skip
    return DraftTree(*ints, mask=mask.view(torch.bool))


def build_tree(
    root_tokens: torch.Tensor,  # [B] int64
    pool_scores: torch.Tensor,  # [B, P] float32
    pool_tokens: torch.Tensor,  # [B, P] int64
    pool_parents: torch.Tensor,  # [B, P] int64
    num_draft_tokens: int,
    impl: str = "torch",
) -> DraftTree:
    fn = pick_impl(impl, build_tree_ref, build_tree_triton)
    return fn(root_tokens, pool_scores, pool_tokens, pool_parents, num_draft_tokens)
