"""Which draft tokens the target accepts: pad every request's tree to one shape, process each
node's logits (the tokens before a node count: per-node history for penalties, per-node grammar
masks for constrained requests, `target_service.grammar`), draw each node's
token as plain decoding would at that output position (the argmax, or the keyed Gumbel-max
draw: `runtime.sampling`), then follow the draws down the tree (`kernels.tree_verify`'s greedy
verifier): a child is accepted exactly when it is its parent's draw, and the last accepted
node's draw is the bonus token. Lossless by construction, and a seed fixes the output whatever
the draft proposed."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specmesh.kernels.tree_verify import TreeVerifyResult, verify_tree_greedy
from specmesh.runtime.sampling import (
    TokenHistory,
    apply_history,
    draw_tokens,
    processed_logprobs,
)
from specmesh.target_service.grammar import mask_logits, padded_masks

if TYPE_CHECKING:
    from specmesh.target_service.verify import VerifyRow


_LINKS = (("ids", 0), ("first_child", -1), ("next_sibling", -1))  # Tree fields, padding


@dataclass
class Acceptance:
    result: TreeVerifyResult
    # When a request asks for logprobs: per node, the log-probabilities of the distribution the
    # token after that node is drawn from (the same the verifier used). [bs, n_max, vocab] fp32
    logprobs: torch.Tensor | None = None


def accept_trees(
    inputs: list[VerifyRow], logits: torch.Tensor, n_max: int, impl: str = "torch"
) -> Acceptance:
    """Accept a path of every request's tree by following each node's draw (the module
    docstring). ``impl`` picks the draw's and the verifier's kernels
    (`specmesh.kernels.common.kernel_impl`).

    Node i's logits predict the token after it, so its processors read the request's history
    plus the path root..i (the root, the pending token, is already in the history) and count
    ``sample_offset + depth(i)`` generated tokens: exactly what plain decoding would see had it
    emitted that path, so verification stays lossless."""
    bs = len(inputs)
    # tokens, first child, next sibling of every node; padding: token 0, no links. Built from
    # the trees' host ints and verified where the logits are: one tensor, one copy.
    host = [[_padded(getattr(i.tree, f), n_max, fill) for i in inputs] for f, fill in _LINKS]
    tree = torch.tensor(host, dtype=torch.int64).to(logits.device).unbind(0)
    counts = [i.tree.num_nodes for i in inputs]
    padded = pad_rows(logits, counts, n_max).flatten(0, 1)  # [bs * n_max, vocab]
    if any(i.grammar is not None for i in inputs):  # -inf where a node's path forbids a token
        trees = [(list(i.tree.ids), list(i.tree.parents)) for i in inputs]
        allow = padded_masks([i.grammar for i in inputs], trees, n_max, padded.shape[-1])
        padded = mask_logits(padded, allow)
    params = [i.params for i in inputs for _ in range(n_max)]
    histories, generated = node_histories(inputs, n_max)
    padded = apply_history(padded, params, histories, generated)
    lp = None
    if any(i.params.logprobs is not None for i in inputs):
        lp = processed_logprobs(padded, params).view(bs, n_max, -1)
    # Every node's token drawn as plain decoding would draw it at that position (the argmax,
    # or the keyed Gumbel-max draw); a child is accepted exactly when it is its parent's draw.
    target_ids = draw_tokens(padded, params, generated, impl).view(bs, n_max)
    return Acceptance(verify_tree_greedy(*tree, target_ids, impl=impl), lp)


def node_histories(
    inputs: list[VerifyRow], n_max: int
) -> tuple[list[TokenHistory | None] | None, list[int]]:
    """Per padded node: the request's history extended by the path to it, and the tokens
    generated before the one it predicts. (None, ...) when no request keeps a history."""
    generated = [i.sample_offset + d for i in inputs for d in _padded(i.tree.levels, n_max)]
    if all(i.history is None for i in inputs):
        return None, generated
    histories: list[TokenHistory | None] = []
    for inp in inputs:
        nodes: list[TokenHistory | None] = [inp.history] + [None] * (n_max - 1)
        if inp.history is not None:
            toks, parents = inp.tree.ids, inp.tree.parents
            for i in range(1, inp.tree.num_nodes):
                nodes[i] = nodes[parents[i]].extended([toks[i]])
        histories.extend(nodes)
    return histories, generated


def _padded(xs: tuple[int, ...], n_max: int, fill: int = 0) -> list[int]:
    return [*xs, *[fill] * (n_max - len(xs))]


def padded_row_index(
    counts: list[int], n_max: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Map padded position ``b * n_max + i`` to the flat row of node i of request b (row 0 for
    padding), on ``device``. Kept per (counts, device), so steady rounds copy nothing to the
    device: shared between calls, read it, never write it."""
    return _row_index(tuple(counts), n_max, str(device))


@functools.lru_cache(maxsize=256)
def _row_index(counts: tuple[int, ...], n_max: int, device: str) -> torch.Tensor:
    starts = [0, *itertools.accumulate(counts)][:-1]
    idx = [
        r
        for s, n in zip(starts, counts, strict=True)
        for r in (*range(s, s + n), *[0] * (n_max - n))
    ]
    return torch.tensor(idx, dtype=torch.int64).to(device)


def pad_rows(x: torch.Tensor, counts: list[int], n_max: int) -> torch.Tensor:
    """``x``'s rows (each request's ``counts[b]`` in turn) as ``[bs, n_max, ...]``, padding
    rows copying row 0; trees of equal size are the grid already (a view, nothing copied)."""
    if all(c == n_max for c in counts):
        return x.view(len(counts), n_max, *x.shape[1:])
    idx = padded_row_index(counts, n_max, x.device)
    return x[idx].view(len(counts), n_max, *x.shape[1:])
