"""Tree verification: walk each request's draft tree down the path the target model accepts.

A tree has N nodes; node 0 is the root (the last committed token, whose KV is not cached yet).
Children of a node are scanned in ``first_child`` -> ``next_sibling`` order. Sibling tokens must
be distinct (top-k expansion guarantees it). Output: the accepted path (tree indices, starting
with 0, padded with -1), its length (root included) and the bonus token emitted after it.

Greedy: at node n move to the first child whose token equals ``target_ids[n]``; bonus =
``target_ids[last node]``.

Sampled requests use the same walk: the target draws each node's token by the sampling contract
(a keyed Gumbel-max draw per output position, `specmesh.runtime.sampling`) and passes the draws
as ``target_ids``; why that is lossless is in `specmesh.target_service.acceptance`.

Bit-exactness: both implementations compare token ids only, so there is nothing to round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import pick_impl


@dataclass
class TreeVerifyResult:
    accept_path: torch.Tensor  # [B, N] int64, tree indices from the root, -1 padded
    accept_len: torch.Tensor  # [B] int64, nodes on the path (>= 1, root included)
    bonus: torch.Tensor  # [B] int64, token emitted after the path


# ---------------------------------------------------------------- torch reference (batched)


def verify_tree_greedy_ref(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_ids: torch.Tensor,  # [B, N] int64, the target's argmax after each node
) -> TreeVerifyResult:
    """The walk on host integers (one copy of each input, three tensors out): greedy
    verification compares token ids only, so there is nothing to round."""
    batch, n = draft_tokens.shape
    draft, first, sibling, wanted = (
        t.tolist() for t in (draft_tokens, first_child, next_sibling, target_ids)
    )
    paths, lens, bonus = [], [], []
    for b in range(batch):
        path = [0]
        while len(path) < n:
            node, child = path[-1], first[b][path[-1]]
            while child >= 0 and draft[b][child] != wanted[b][node]:
                child = sibling[b][child]
            if child < 0:
                break
            path.append(child)
        paths.append(path + [-1] * (n - len(path)))
        lens.append(len(path))
        bonus.append(wanted[b][path[-1]])
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64).to(draft_tokens.device)
    return TreeVerifyResult(as_t(paths).view(batch, n), as_t(lens), as_t(bonus))


# ---------------------------------------------------------------- Triton (one program / request)


@triton.jit
def _greedy_kernel(draft, first_child, next_sibling, target_ids, path, accept_len, bonus, N):
    row = tl.program_id(0).to(tl.int64) * N  # this request's offset in the [B, N] inputs
    node = tl.zeros((), tl.int64)
    length = node + 1
    go = length > 0
    while go:
        wanted = tl.load(target_ids + row + node)
        child = tl.load(first_child + row + node)
        chosen = node * 0 - 1
        while (child >= 0) & (chosen < 0):
            chosen = tl.where(tl.load(draft + row + child) == wanted, child, chosen)
            child = tl.load(next_sibling + row + child)
        go = (chosen >= 0) & (length < N)
        tl.store(path + row + length, chosen, mask=go)
        length += go.to(tl.int64)
        node = tl.where(go, chosen, node)
    tl.store(accept_len + tl.program_id(0), length)
    tl.store(bonus + tl.program_id(0), tl.load(target_ids + row + node))


def _empty_result(draft_tokens: torch.Tensor) -> TreeVerifyResult:
    batch, n = draft_tokens.shape
    path = torch.full((batch, n), -1, dtype=torch.int64, device=draft_tokens.device)  # [B, N]
    path[:, 0] = 0
    lens = torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)  # [B]
    return TreeVerifyResult(path, lens, torch.empty_like(lens))


def verify_tree_greedy_triton(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_ids: torch.Tensor,  # [B, N] int64
) -> TreeVerifyResult:
    res = _empty_result(draft_tokens)
    ins = [t.contiguous() for t in (draft_tokens, first_child, next_sibling, target_ids)]
    _greedy_kernel[(draft_tokens.shape[0],)](
        *ins, res.accept_path, res.accept_len, res.bonus, draft_tokens.shape[1]
    )
    return res


def verify_tree_greedy(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_ids: torch.Tensor,  # [B, N] int64
    impl: str = "torch",
) -> TreeVerifyResult:
    fn = pick_impl(impl, verify_tree_greedy_ref, verify_tree_greedy_triton)
    return fn(draft_tokens, first_child, next_sibling, target_ids)
