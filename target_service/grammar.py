"""Grammar masks on the target (`protocol.constraints`): a constrained request's every sampled
token, and every tree node it verifies, is drawn from the tokens its grammar allows there.

Per request the target keeps one llguidance matcher that has consumed every committed token,
the pending one included (the prefill's first token, each verify's accepted tokens and bonus:
`TargetRuntime.advance`); a replay (failover, preemption) rebuilds it from the emitted tokens it
is sent. Verify walks the tree: node i's state is a copy of its parent's that consumed node i's
token, so node i's mask is exactly the one plain constrained decoding computes after the path
root..i. A node whose token the grammar refuses gets no state: it can never be accepted (its
parent's draw is masked to allowed tokens), so its row and its subtree's stay unmasked
(rollback is structural: the request's own matcher never saw the node).

    committed tokens ... pending │ tree: root=pending ─ a ─ b      state(a) = copy(root) + a
    request matcher ─────────────┘                    └ c ─ d      state(d) = copy(c) + d

Masked logits are -inf where the grammar refuses, before every other processor, so greedy takes
the allowed argmax and the keyed draws (`runtime.sampling`) sample the constrained distribution:
the output equals constrained decoding without speculation, greedy and seeded.
"""

from __future__ import annotations

from typing import Any

import torch

# Compiling, the per-request matcher and its mask are shared with the draft (`runtime.grammar`).
from specmesh.runtime.grammar import MAX_COMPILED, Grammars, allowed, consume

__all__ = [
    "MAX_COMPILED", "Grammars", "allowed", "consume", "mask_logits", "padded_masks",
    "row_masks", "tree_masks",
]  # fmt: skip


def tree_masks(
    matcher: Any, tokens: list[int], parents: list[int], vocab_size: int
) -> torch.Tensor:
    """``[n, vocab]`` bool: row i, the tokens the grammar allows after the path root..i (the
    root, the pending token, is already consumed by ``matcher``, which is not changed). Nodes
    off the grammar, and their subtrees, allow everything (the module docstring)."""
    n = len(tokens)
    rows = torch.ones(n, vocab_size, dtype=torch.bool)
    states: list[Any] = [matcher] + [None] * (n - 1)
    rows[0] = allowed(matcher, vocab_size)
    for i in range(1, n):  # parents come before children
        parent = states[parents[i]]
        if parent is None:
            continue
        state = parent.deep_copy()
        if state.consume_token(tokens[i]):
            states[i], rows[i] = state, allowed(state, vocab_size)
    return rows


def mask_logits(logits: torch.Tensor, allow: torch.Tensor | None) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with -inf where ``allow`` (``[rows, vocab]`` bool) is
    False; ``logits`` itself when there is no mask."""
    if allow is None:
        return logits
    return logits.masked_fill(~allow.to(logits.device), float("-inf"))


def row_masks(matchers: list[Any | None], vocab_size: int) -> torch.Tensor | None:
    """``[rows, vocab]`` bool, one row per matcher (None: everything allowed); None when no
    row is constrained."""
    if all(m is None for m in matchers):
        return None
    out = torch.ones(len(matchers), vocab_size, dtype=torch.bool)
    for r, matcher in enumerate(matchers):
        if matcher is not None:
            out[r] = allowed(matcher, vocab_size)
    return out


def padded_masks(
    matchers: list[Any | None], trees: list[tuple[list[int], list[int]]], n_max: int,
    vocab_size: int,
) -> torch.Tensor | None:  # fmt: skip
    """``[bs * n_max, vocab]`` bool for trees padded to ``n_max`` nodes (``trees``: per request,
    its tokens and parents); None when no request is constrained."""
    if all(m is None for m in matchers):
        return None
    out = torch.ones(len(matchers) * n_max, vocab_size, dtype=torch.bool)
    for b, (matcher, (tokens, parents)) in enumerate(zip(matchers, trees, strict=True)):
        if matcher is not None:
            out[b * n_max : b * n_max + len(tokens)] = tree_masks(
                matcher, tokens, parents, vocab_size
            )
    return out
