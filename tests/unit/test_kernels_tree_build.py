"""Tree building from the drafting pool: Triton against the reference, and the tree invariants."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from specmesh.kernels.testing import kernel_devices
from specmesh.kernels.tree_build import DraftTree, build_tree


def make_pool(batch: int, topk: int, num_steps: int, seed: int, ties: bool):
    """A pool as top-k drafting makes it: step 0 scores k root children; each later step expands
    the k best of the previous step's candidates into k children each."""
    gen = torch.Generator().manual_seed(seed)
    factor = lambda *shape: (
        torch.tensor([0.25, 0.5, 1.0])[torch.randint(3, shape, generator=gen)]
        if ties else torch.rand(*shape, generator=gen)
    )  # fmt: skip
    scores = [factor(batch, topk)]
    parents = [torch.full((batch, topk), -1, dtype=torch.int64)]
    frontier = torch.arange(topk).expand(batch, -1)  # pool indices of the last step's best k
    offset = topk
    for _ in range(1, num_steps):
        parent_scores = torch.cat(scores, 1).gather(1, frontier)  # [B, k]
        child = (parent_scores[:, :, None] * factor(batch, topk, topk)).flatten(1)  # [B, k*k]
        scores.append(child)
        parents.append(frontier.repeat_interleave(topk, dim=1))
        frontier = offset + child.topk(topk, dim=1).indices
        offset += topk * topk
    tokens = torch.randint(0, 100, (batch, offset), generator=gen)
    root = torch.randint(0, 100, (batch,), generator=gen)
    return root, torch.cat(scores, 1), tokens, torch.cat(parents, 1)


def check_invariants(tree: DraftTree, root, scores, tokens, parents, n: int) -> None:
    for b in range(root.numel()):
        keyed = sorted(range(scores.shape[1]), key=lambda p: (-float(scores[b, p]), p))
        chosen = sorted(keyed[: n - 1])
        assert tree.tokens[b].tolist() == [int(root[b]), *tokens[b, chosen].tolist()]
        for i in range(1, n):
            par = int(tree.parents[b, i])
            want = parents[b, chosen[i - 1]]
            assert par == (0 if want < 0 else chosen.index(int(want)) + 1) and par < i
            assert tree.depths[b, i] == tree.depths[b, par] + 1
            ancestors, a = {i}, par
            while a >= 0:
                ancestors.add(a)
                a = int(tree.parents[b, a])
            assert tree.mask[b, i].nonzero().flatten().tolist() == sorted(ancestors)
        kids = {p: [i for i in range(n) if tree.parents[b, i] == p] for p in range(n)}
        for p, ch in kids.items():
            assert tree.first_child[b, p] == (ch[0] if ch else -1)
            for k, c in enumerate(ch):
                assert tree.next_sibling[b, c] == (ch[k + 1] if k + 1 < len(ch) else -1)
    assert tree.parents[:, 0].eq(-1).all() and tree.depths[:, 0].eq(0).all()


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("batch", "topk", "num_steps", "n"), [
    (1, 1, 1, 1), (1, 2, 3, 9), (3, 3, 3, 12), (2, 4, 2, 21),  # n=21: the whole pool
])  # fmt: skip
def test_triton_matches_reference(device, ties, batch, topk, num_steps, n) -> None:
    root, scores, tokens, parents = make_pool(batch, topk, num_steps, seed=n, ties=ties)
    ref = build_tree(root, scores, tokens, parents, n, impl="torch")
    check_invariants(ref, root, scores, tokens, parents, n)
    args = [t.to(device) for t in (root, scores, tokens, parents)]
    out = build_tree(*args, n, impl="triton")
    for field in ("tokens", "parents", "depths", "first_child", "next_sibling", "mask"):
        assert torch.equal(getattr(out, field).cpu(), getattr(ref, field)), field


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_too_many_draft_tokens(impl: str) -> None:
    root, scores, tokens, parents = make_pool(1, 2, 2, seed=0, ties=False)  # pool of 6
    with pytest.raises(ValueError, match="needs 7 pool entries, the pool holds 6"):
        build_tree(root, scores, tokens, parents, 8, impl=impl)
