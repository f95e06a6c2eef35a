"""Tree selection from the drafting pool: the chosen entries and their parents, on every device,
against an independent walk of the pool (a parent always before its child)."""

import pytest
import torch

from specmesh.kernels.tree_build import select_tree

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]  # fmt: skip


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


def check_selection(tokens_out, parents_out, root, scores, tokens, parents, n: int) -> None:
    """The N-1 best entries by (score descending, pool index), in pool order after the root;
    each node's parent is its pool parent's tree index, before it."""
    for b in range(root.numel()):
        keyed = sorted(range(scores.shape[1]), key=lambda p: (-float(scores[b, p]), p))
        chosen = sorted(keyed[: n - 1])
        assert tokens_out[b].tolist() == [int(root[b]), *tokens[b, chosen].tolist()]
        assert int(parents_out[b, 0]) == -1
        for i in range(1, n):
            par = int(parents_out[b, i])
            want = parents[b, chosen[i - 1]]
            assert par == (0 if want < 0 else chosen.index(int(want)) + 1) and 0 <= par < i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("batch", "topk", "num_steps", "n"), [
    (1, 1, 1, 1), (1, 2, 3, 9), (3, 3, 3, 12), (2, 4, 2, 21),  # n=21: the whole pool
])  # fmt: skip
def test_selection_on_every_device(device, ties, batch, topk, num_steps, n) -> None:
    root, scores, tokens, parents = make_pool(batch, topk, num_steps, seed=n, ties=ties)
    args = [t.to(device) for t in (root, scores, tokens, parents)]
    out_tokens, out_parents = select_tree(*args, n)
    assert out_tokens.device.type == out_parents.device.type == torch.device(device).type
    check_selection(out_tokens.cpu(), out_parents.cpu(), root, scores, tokens, parents, n)


def test_too_many_draft_tokens() -> None:
    root, scores, tokens, parents = make_pool(1, 2, 2, seed=0, ties=False)  # pool of 6
    with pytest.raises(ValueError, match="needs 7 pool entries, the pool holds 6"):
        select_tree(root, scores, tokens, parents, 8)
