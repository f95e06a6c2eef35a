"""Tree verification: walk each request's draft tree down the path the target model accepts.

A tree has N nodes; node 0 is the root (the last committed token, whose KV is not cached yet).
Children of a node are scanned in ``first_child`` -> ``next_sibling`` order. Sibling tokens must
be distinct (top-k expansion guarantees it). Output: the accepted path (tree indices, starting
with 0, padded with -1), its length (root included) and the bonus token emitted after it.

Greedy: at node n move to the first child whose token equals ``target_ids[n]``; bonus =
``target_ids[last node]``.

Sampling (lossless, target-only): at node n with target distribution p and one uniform u, scan
the children x_1..x_m accumulating ``P_i = p(x_1) + ... + p(x_i)`` and accept the first child
with ``u < P_i``. Otherwise stop and draw the bonus from the residual ``r = p`` with every child
token zeroed, by inverse CDF with the final uniform. Why this is exactly lossless: child x_i is
taken iff ``P_{i-1} <= u < P_i``, with probability p(x_i); any other token x is emitted with
probability ``(1 - sum_i p(x_i)) * p(x) / (1 - sum_i p(x_i)) = p(x)``. So the next emitted token
is distributed as p; after accepting x_i the walk continues at that child with the target's
distribution given x_i, with a fresh uniform, and by induction the whole emitted sequence has
the target model's distribution, whatever the draft proposed.

Bit-exactness: both implementations add child probabilities one by one in fp32 and take the
residual's CDF as a sequential fp32 cumulative sum over the vocabulary (``np.add.accumulate``
in the reference: torch's CPU cumsum accumulates float32 in float64), with the threshold
``final_u * cdf[-1]``. The Triton kernel runs one program per request and repeats those exact
operations, so both pick the same indices on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from specmesh.kernels.common import next_pow2, pick_impl


@dataclass
class TreeVerifyResult:
    accept_path: torch.Tensor  # [B, N] int64, tree indices from the root, -1 padded
    accept_len: torch.Tensor  # [B] int64, nodes on the path (>= 1, root included)
    bonus: torch.Tensor  # [B] int64, token emitted after the path


# ---------------------------------------------------------------- torch reference (batched)


def _children(
    first_child: torch.Tensor, next_sibling: torch.Tensor, node: torch.Tensor
) -> Iterator[torch.Tensor]:
    """Per request, the children of ``node`` [B] in scan order: one [B] tensor per position,
    -1 where a request has run out of children."""
    rows = torch.arange(node.numel(), device=node.device)
    child = first_child[rows, node]
    while bool((child >= 0).any()):
        yield child
        child = torch.where(child >= 0, next_sibling[rows, child.clamp(min=0)], -1)


def _walk(
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    choose: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow ``choose(node) -> child or -1`` from the root; returns (path, len, last node)."""
    batch, n = first_child.shape
    rows = torch.arange(batch, device=first_child.device)
    path = torch.full((batch, n), -1, dtype=torch.int64, device=first_child.device)  # [B, N]
    path[:, 0] = 0
    accept_len = torch.ones(batch, dtype=torch.int64, device=first_child.device)  # [B]
    node = torch.zeros_like(accept_len)
    active = torch.ones(batch, dtype=torch.bool, device=first_child.device)
    while bool(active.any()):
        child = choose(node)
        active = active & (child >= 0) & (accept_len < n)
        path[rows[active], accept_len[active]] = child[active]
        accept_len += active
        node = torch.where(active, child, node)
    return path, accept_len, node


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


def sequential_cumsum_fp32(x: torch.Tensor) -> torch.Tensor:
    """Row-wise cumulative sum adding left to right in float32 (the order the kernel uses)."""
    acc = np.add.accumulate(x.detach().cpu().float().numpy(), axis=-1, dtype=np.float32)
    return torch.from_numpy(acc).to(x.device)


def _residual_sample(
    probs: torch.Tensor, residual: torch.Tensor, final_uniforms: torch.Tensor
) -> torch.Tensor:  # [B] int64
    """Smallest t with ``cdf[t] > u * cdf[-1]``, clamped to the last t with residual > 0 (or
    with p > 0 when every token of p is a child, which only fp rounding allows)."""
    vocab = residual.shape[-1]
    cdf = sequential_cumsum_fp32(residual)  # [B, V]
    threshold = final_uniforms * cdf[:, -1]  # [B], one fp32 multiply
    first = (cdf <= threshold[:, None]).sum(dim=-1)  # cdf is non-decreasing
    last_r = vocab - 1 - (residual.flip(-1) > 0).int().argmax(dim=-1)
    last_p = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(first, torch.where((residual > 0).any(-1), last_r, last_p))


def verify_tree_sampling_ref(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_probs: torch.Tensor,  # [B, N, V] float32, processed target distribution per node
    accept_uniforms: torch.Tensor,  # [B, N] float32, one uniform per node
    final_uniforms: torch.Tensor,  # [B] float32, for the bonus token
) -> TreeVerifyResult:
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)

    def choose(node: torch.Tensor) -> torch.Tensor:
        p, u = target_probs[rows, node], accept_uniforms[rows, node]  # [B, V], [B]
        mass = torch.zeros_like(u)  # [B] fp32, P_i
        chosen = torch.full_like(node, -1)
        for child in _children(first_child, next_sibling, node):
            valid = child >= 0
            token = draft_tokens[rows, child.clamp(min=0)]
            mass = torch.where(valid, mass + p[rows, token], mass)
            chosen = torch.where(valid & (chosen < 0) & (u < mass), child, chosen)
        return chosen

    path, accept_len, last = _walk(first_child, next_sibling, choose)
    probs = target_probs[rows, last]  # [B, V]
    residual = probs.clone()
    for child in _children(first_child, next_sibling, last):
        valid = child >= 0
        residual[rows[valid], draft_tokens[rows, child.clamp(min=0)][valid]] = 0.0
    return TreeVerifyResult(path, accept_len, _residual_sample(probs, residual, final_uniforms))


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


@triton.jit
def _child_token_mask(draft, first_child, next_sibling, row, node, offs):
    """Boolean block: which of the vocabulary indices ``offs`` are tokens of node's children."""
    hit = offs < 0
    child = tl.load(first_child + row + node)
    while child >= 0:
        hit = hit | (offs == tl.load(draft + row + child))
        child = tl.load(next_sibling + row + child)
    return hit


@triton.jit
def _sampling_kernel(
    draft, first_child, next_sibling, probs, accept_u, final_u, path, accept_len, bonus,
    N, V, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    row = b * N
    node = tl.zeros((), tl.int64)
    length = node + 1
    go = length > 0
    while go:  # accept children while u < P_i
        p_row = probs + (row + node) * V
        u = tl.load(accept_u + row + node)
        child = tl.load(first_child + row + node)
        chosen = node * 0 - 1
        mass = tl.zeros((), tl.float32)
        while (child >= 0) & (chosen < 0):
            mass = mass + tl.load(p_row + tl.load(draft + row + child))
            chosen = tl.where(u < mass, child, chosen)
            child = tl.load(next_sibling + row + child)
        go = (chosen >= 0) & (length < N)
        tl.store(path + row + length, chosen, mask=go)
        length += go.to(tl.int64)
        node = tl.where(go, chosen, node)

    # Residual at the stop node, scanned element by element in fp32 (pass 1: total).
    p_row = probs + (row + node) * V
    total = tl.zeros((), tl.float32)
    last_r = node * 0 - 1
    last_p = node * 0 + V - 1
    last_p_seen = node * 0 - 1
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p_blk = tl.load(p_row + offs, mask=offs < V, other=0.0)
        is_child = _child_token_mask(draft, first_child, next_sibling, row, node, offs)
        r_blk = tl.where(is_child, 0.0, p_blk)
        for j in range(0, BLOCK_V):  # extracting one lane is exact: x + 0 + ... + 0 == x
            total = total + tl.sum(tl.where(offs == start + j, r_blk, 0.0), axis=0)
        last_r = tl.maximum(last_r, tl.max(tl.where(r_blk > 0, offs, -1), axis=0))
        last_p_seen = tl.maximum(last_p_seen, tl.max(tl.where(p_blk > 0, offs, -1), axis=0))
    last_p = tl.where(last_p_seen >= 0, last_p_seen, last_p)
    threshold = tl.load(final_u + b) * total

    # Pass 2: the first index whose running sum exceeds the threshold.
    cdf = tl.zeros((), tl.float32)
    first = node * 0 + V
    start = node * 0
    while (start < V) & (first == V):
        offs = start + tl.arange(0, BLOCK_V)
        p_blk = tl.load(p_row + offs, mask=offs < V, other=0.0)
        is_child = _child_token_mask(draft, first_child, next_sibling, row, node, offs)
        r_blk = tl.where(is_child, 0.0, p_blk)
        for j in range(0, BLOCK_V):
            cdf = cdf + tl.sum(tl.where(offs == start + j, r_blk, 0.0), axis=0)
            first = tl.where((cdf > threshold) & (first == V), start + j, first)
        start += BLOCK_V
    tl.store(accept_len + b, length)
    tl.store(bonus + b, tl.minimum(first, tl.where(last_r >= 0, last_r, last_p)))


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


def verify_tree_sampling_triton(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_probs: torch.Tensor,  # [B, N, V] float32
    accept_uniforms: torch.Tensor,  # [B, N] float32
    final_uniforms: torch.Tensor,  # [B] float32
) -> TreeVerifyResult:
    res = _empty_result(draft_tokens)
    vocab = target_probs.shape[-1]
    ins = [t.contiguous() for t in (draft_tokens, first_child, next_sibling)]
    floats = [t.float().contiguous() for t in (target_probs, accept_uniforms, final_uniforms)]
    _sampling_kernel[(draft_tokens.shape[0],)](
        *ins, *floats, res.accept_path, res.accept_len, res.bonus,
        draft_tokens.shape[1], vocab, BLOCK_V=min(128, next_pow2(vocab)),
    )  # fmt: skip
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


def verify_tree_sampling(
    draft_tokens: torch.Tensor,  # [B, N] int64
    first_child: torch.Tensor,  # [B, N] int64
    next_sibling: torch.Tensor,  # [B, N] int64
    target_probs: torch.Tensor,  # [B, N, V] float32
    accept_uniforms: torch.Tensor,  # [B, N] float32
    final_uniforms: torch.Tensor,  # [B] float32
    impl: str = "torch",
) -> TreeVerifyResult:
    fn = pick_impl(impl, verify_tree_sampling_ref, verify_tree_sampling_triton)
    return fn(draft_tokens, first_child, next_sibling, target_probs, accept_uniforms,
              final_uniforms)  # fmt: skip
