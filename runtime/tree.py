"""A draft tree as the target receives it: tokens and parent indices, node 0 the root.

Everything else (depths, the ancestor mask, first-child / next-sibling links) is derived here, so
a tree from the wire is validated once and cannot disagree with itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] int64, tokens[0] is the root (the request's pending token)
    parents: torch.Tensor  # [N] int64, parents[0] == -1, parents[i] < i
    depths: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [N, N] bool, i sees j iff j is an ancestor of i or j == i
    first_child: torch.Tensor  # [N] int64, -1 for a leaf
    next_sibling: torch.Tensor  # [N] int64, -1 for the last child

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def from_parents(tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor) -> Tree:
        tokens_t = torch.as_tensor(
            tokens, dtype=torch.int64, device="cpu"
        )  # trees live on the host
        par = [int(p) for p in parents]
        n = len(par)
        if n == 0 or tokens_t.numel() != n:
            raise InvalidRequestError(f"tree has {tokens_t.numel()} tokens and {n} parents")
        if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
            raise InvalidRequestError(
                f"tree parents must be -1 for node 0 and < i for node i: {par}"
            )
        # Host lists first, one tensor per field at the end: a tree is small, a torch op per
        # node is not. ``seen[i]``: bit j set iff node j is i or one of its ancestors.
        depths, seen = [0] * n, [1] + [0] * (n - 1)
        first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
        for i in range(1, n):
            p = par[i]
            depths[i], seen[i] = depths[p] + 1, seen[p] | 1 << i
            if first_child[p] < 0:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        mask = torch.tensor([[bits >> j & 1 for j in range(n)] for bits in seen], dtype=torch.bool)
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)
        return Tree(tokens_t, as_t(par), as_t(depths), mask, as_t(first_child), as_t(next_sibling))

    @staticmethod
    def chain(tokens: list[int]) -> Tree:
        return Tree.from_parents(tokens, list(range(-1, len(tokens) - 1)))
