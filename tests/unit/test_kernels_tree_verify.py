"""Tree verification: the Triton walk against the reference bit for bit, and edge cases (sampled
requests walk the same way over their keyed draws: `test_seeded_sampling`)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from specmesh.kernels.testing import cpu_triton, kernel_devices
from specmesh.kernels.tree_verify import (
    TreeVerifyResult,
    verify_tree_greedy,
)


def links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """first_child / next_sibling [B, N] from parents [B, N] (children in ascending index)."""
    batch, n = parents.shape
    first_child = torch.full((batch, n), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, n), -1, dtype=torch.int64)
    for b in range(batch):
        last: dict[int, int] = {}
        for i in range(1, n):
            p = int(parents[b, i])
            if p in last:
                next_sibling[b, last[p]] = i
            else:
                first_child[b, p] = i
            last[p] = i
    return first_child, next_sibling


def random_trees(batch: int, n: int, vocab: int, gen: torch.Generator, chain: bool = False):
    """Random trees with distinct tokens per request (so siblings differ)."""
    parents = torch.zeros(batch, n, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = i - 1 if chain else torch.randint(0, i, (batch,), generator=gen)
    parents[:, 0] = -1
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(batch)])
    return tokens, parents, *links(parents)


def assert_same(a: TreeVerifyResult, b: TreeVerifyResult) -> None:
    assert torch.equal(a.accept_path.cpu(), b.accept_path.cpu())
    assert torch.equal(a.accept_len.cpu(), b.accept_len.cpu())
    assert torch.equal(a.bonus.cpu(), b.bonus.cpu())


def greedy_targets(tokens, parents, first_child, gen, hit_rate: float) -> torch.Tensor:
    """target_ids: with probability hit_rate a random child's token, else a token no node has."""
    batch, n = tokens.shape
    target = torch.full((batch, n), 10_000, dtype=torch.int64)
    for b in range(batch):
        for node in range(n):
            kids = (parents[b] == node).nonzero().flatten()
            if len(kids) and torch.rand((), generator=gen) < hit_rate:
                target[b, node] = tokens[b, kids[torch.randint(len(kids), (), generator=gen)]]
    return target


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("hit_rate", [0.0, 0.7, 1.0])
def test_greedy_triton_matches_reference(device: str, hit_rate: float) -> None:
    gen = torch.Generator().manual_seed(1)
    for batch, n in [(1, 1), (1, 6), (5, 9)]:
        tokens, parents, fc, ns = random_trees(batch, n, 50, gen)
        target = greedy_targets(tokens, parents, fc, gen, hit_rate)
        args = [t.to(device) for t in (tokens, fc, ns, target)]
        ref = verify_tree_greedy(*args, impl="torch")
        assert_same(ref, verify_tree_greedy(*args, impl="triton"))
        if hit_rate == 0.0:  # all rejected: path is the root, bonus the root's target
            assert ref.accept_len.tolist() == [1] * batch
            assert torch.equal(ref.bonus.cpu(), target[:, 0])


@pytest.mark.parametrize("impl", ["torch", cpu_triton()])
def test_greedy_full_chain_accepted(impl: str) -> None:
    tokens, _, fc, ns = random_trees(2, 5, 20, torch.Generator().manual_seed(2), chain=True)
    target = torch.cat([tokens[:, 1:], torch.tensor([[7], [8]])], dim=1)
    res = verify_tree_greedy(tokens, fc, ns, target, impl=impl)
    assert res.accept_len.tolist() == [5, 5]
    assert res.accept_path.tolist() == [list(range(5))] * 2
    assert res.bonus.tolist() == [7, 8]
