"""Which draft tokens the target accepts: pad every request's tree to one shape, then run the
greedy or the lossless sampling tree verifier (`specmesh.kernels.tree_verify`)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from specmesh.kernels.tree_verify import TreeVerifyResult, verify_tree_greedy, verify_tree_sampling
from specmesh.runtime.sampling import processed_probs, uniforms

if TYPE_CHECKING:
    from specmesh.target_service.steps import VerifyInput


def accept_trees(
    inputs: list[VerifyInput], logits: torch.Tensor, n_max: int, impl: str = "torch"
) -> TreeVerifyResult:
    """Accept a path of every request's tree: greedy when every request is greedy, else by
    lossless tree sampling with each request's own uniforms (seed, generation offset). ``impl``
    picks the verifier kernel (`specmesh.kernels.common.kernel_impl`)."""
    bs = len(inputs)
    tokens = torch.zeros(bs, n_max, dtype=torch.int64)
    first_child = torch.full((bs, n_max), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, n_max), -1, dtype=torch.int64)
    for b, inp in enumerate(inputs):
        n = inp.tree.num_nodes
        tokens[b, :n], first_child[b, :n], next_sibling[b, :n] = (
            inp.tree.tokens,
            inp.tree.first_child,
            inp.tree.next_sibling,
        )
    dev = logits.device  # the trees are built on the host, verified where the logits are
    tree = [t.to(dev) for t in (tokens, first_child, next_sibling)]
    counts = [i.tree.num_nodes for i in inputs]
    padded = pad_rows(logits, counts, n_max)  # [bs, n_max, vocab]
    if all(i.params.greedy for i in inputs):
        return verify_tree_greedy(*tree, padded.argmax(-1), impl=impl)
    params = [i.params for i in inputs for _ in range(n_max)]
    probs = processed_probs(padded.flatten(0, 1), params).view(bs, n_max, -1)
    rand = torch.stack([uniforms(i.params.seed or 0, i.sample_offset, n_max + 1) for i in inputs])
    rand = rand.to(dev)
    return verify_tree_sampling(*tree, probs, rand[:, :n_max], rand[:, n_max], impl=impl)


def padded_row_index(counts: list[int], n_max: int) -> torch.Tensor:
    """Map padded position ``b * n_max + i`` to the flat row of node i of request b."""
    starts = [0, *itertools.accumulate(counts)][:-1]
    idx = torch.zeros(len(counts) * n_max, dtype=torch.int64)
    for b, (s, n) in enumerate(zip(starts, counts, strict=True)):
        idx[b * n_max : b * n_max + n] = torch.arange(s, s + n)
    return idx


def pad_rows(x: torch.Tensor, counts: list[int], n_max: int) -> torch.Tensor:
    idx = padded_row_index(counts, n_max).to(x.device)
    return x[idx].view(len(counts), n_max, *x.shape[1:])
