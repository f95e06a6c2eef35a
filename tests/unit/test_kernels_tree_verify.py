"""Tree verification: Triton against the reference bit for bit, edge cases, and a statistical
check that the sampling rule is lossless."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from specmesh.kernels.testing import cpu_triton, kernel_devices
from specmesh.kernels.tree_verify import (
    TreeVerifyResult,
    verify_tree_greedy,
    verify_tree_sampling,
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


def peaked_probs(tokens, parents, vocab: int, gen, boost: float) -> torch.Tensor:
    """[B, N, V] target probabilities with extra mass on each node's children's tokens."""
    batch, n = tokens.shape
    logits = torch.randn(batch, n, vocab, generator=gen)
    for i in range(1, n):
        logits[torch.arange(batch), parents[:, i], tokens[:, i]] += boost
    return logits.softmax(-1)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("boost", [-30.0, 2.0, 5.0])  # all rejected, mixed, mostly accepted
def test_sampling_triton_matches_reference(device: str, boost: float) -> None:
    gen = torch.Generator().manual_seed(3)
    for batch, n, vocab in [(1, 1, 7), (4, 8, 37), (2, 6, 1000)]:
        tokens, parents, fc, ns = random_trees(batch, n, vocab, gen)
        probs = peaked_probs(tokens, parents, vocab, gen, boost)
        u_accept, u_final = torch.rand(batch, n, generator=gen), torch.rand(batch, generator=gen)
        args = [t.to(device) for t in (tokens, fc, ns, probs, u_accept, u_final)]
        ref = verify_tree_sampling(*args, impl="torch")
        assert_same(ref, verify_tree_sampling(*args, impl="triton"))


@pytest.mark.parametrize("device", kernel_devices())
def test_sampling_edge_cases(device: str) -> None:
    """One-hot chain (fully accepted), and children holding all the mass with u above their fp32
    sum, so the residual is empty and the bonus falls back to the last token with p > 0."""
    tokens, _, fc, ns = random_trees(2, 4, 6, torch.Generator().manual_seed(4), chain=True)
    probs = torch.zeros(2, 4, 6)
    probs[0, :3] = torch.nn.functional.one_hot(tokens[0, 1:], 6).float()
    probs[0, 3, 5] = 1.0
    probs[1, 0, tokens[1, 1]] = 0.75  # only child; the rest of the row is zero
    u_accept = torch.tensor([[0.5] * 4, [0.9, 0.0, 0.0, 0.0]])
    args = [t.to(device) for t in (tokens, fc, ns, probs, u_accept, torch.tensor([0.3, 0.3]))]
    ref = verify_tree_sampling(*args, impl="torch")
    assert ref.accept_len.tolist() == [4, 1]
    assert ref.bonus.tolist() == [5, int(tokens[1, 1])]
    assert_same(ref, verify_tree_sampling(*args, impl="triton"))


# Chi-square critical value for 5 degrees of freedom (6 tokens) at significance 0.001.
CHI2_CRIT_DF5 = 20.515


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_sampling_is_lossless() -> None:
    """Root children: A (token 1, children tokens 0 and 2) and B (token 3). The first emitted
    token must follow p_root, and the token after A must follow p_A."""
    draws, vocab = 200_000, 6
    tokens = torch.tensor([[5, 1, 3, 0, 2]]).expand(draws, -1)
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    fc, ns = (t.expand(draws, -1) for t in links(parents))
    p_root = torch.tensor([0.10, 0.25, 0.05, 0.30, 0.20, 0.10])
    p_a = torch.tensor([0.30, 0.05, 0.15, 0.20, 0.10, 0.20])
    p_other = torch.full((vocab,), 1.0 / vocab)
    probs = torch.stack([p_root, p_a, p_other, p_other, p_other])[None].expand(draws, -1, -1)
    gen = torch.Generator().manual_seed(5)
    u_accept, u_final = torch.rand(draws, 5, generator=gen), torch.rand(draws, generator=gen)
    res = verify_tree_sampling(tokens, fc, ns, probs, u_accept, u_final, impl="torch")
    emitted = torch.cat([tokens.gather(1, res.accept_path[:, 1:].clamp(min=0)),
                         torch.zeros(draws, 1, dtype=torch.int64)], 1)  # fmt: skip
    emitted[torch.arange(draws), res.accept_len - 1] = res.bonus  # path tokens, then the bonus
    assert chi_square(emitted[:, 0], p_root) < CHI2_CRIT_DF5
    after_a = emitted[emitted[:, 0] == 1, 1]
    assert after_a.numel() > 40_000
    assert chi_square(after_a, p_a) < CHI2_CRIT_DF5
