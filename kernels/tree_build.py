"""Tree selection: rerank the drafting pool to the N-1 best candidates, as tokens and parents.

Drafting runs S steps of top-k; the candidates (root excluded) form a pool of
``P = k + (S-1) * k * k`` entries per request with a cumulative path score, a token and the pool
index of the parent (-1 = the root); a parent's pool index is smaller than its child's.

Selection: the N-1 best entries by a STABLE descending sort of the scores, then ordered by
ascending pool index, the root prepended. Why every selected node's parent is selected:
``score(child) <= score(parent)`` (a log-probability is added, never positive) and ``parent
index < child index``, so the stable sort puts the parent first; and ascending pool order puts
the parent at a smaller tree index than the child.

Tree index layout (per request)::

    0      1 .. N-1
    root | selected pool entries in ascending pool index (parents before children)

A handful of device operations for the batch, no read back: the draft's trees leave as these
two tensors (one host copy), and the target derives depths, masks and links itself
(`specmesh.target_service.verify.Tree`).
"""

from __future__ import annotations

import torch


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


def select_tree(
    root_tokens: torch.Tensor,  # [B] int64
    pool_scores: torch.Tensor,  # [B, P] float32
    pool_tokens: torch.Tensor,  # [B, P] int64
    pool_parents: torch.Tensor,  # [B, P] int64, -1 = root
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, parents), each ``[B, N]`` int64: the root and the selected entries' tokens, and
    each node's tree index of its parent (-1 for the root)."""
    selected = select_pool_entries(pool_scores, num_draft_tokens)  # [B, N-1]
    batch, n, dev = root_tokens.numel(), num_draft_tokens, root_tokens.device
    tree_of_pool = torch.full_like(pool_parents, -1)  # [B, P]
    tree_of_pool.scatter_(1, selected, torch.arange(1, n, device=dev).expand(batch, -1))
    parent_pool = pool_parents.gather(1, selected)  # [B, N-1]
    parent_tree = tree_of_pool.gather(1, parent_pool.clamp(min=0)).where(parent_pool >= 0, 0)
    parents = torch.cat([torch.full((batch, 1), -1, device=dev), parent_tree], 1)
    tokens = torch.cat([root_tokens[:, None], pool_tokens.gather(1, selected)], 1)
    return tokens, parents
