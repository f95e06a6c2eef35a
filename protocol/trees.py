"""A draft tree as it crosses a boundary: tokens and parent indices, nothing derived.

The draft builds it from its kernel's output, the router forwards (and may cut) it, the target
turns it into `specmesh.target_service.verify.Tree` (depths, ancestor mask, sibling links)
once, where the mask is used, and validates it there. Node 0 is the root: the request's pending token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # tokens[0] is the root
    parents: tuple[int, ...]  # parents[0] == -1; parents[i] < i (checked by the target)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @staticmethod
    def of(tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(parents))

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def cut(self, k: int) -> DraftTree:
        """The first ``k`` nodes (parents come before their children, so they are a tree with
        the same root)."""
        return self if k >= self.num_nodes else DraftTree(self.tokens[:k], self.parents[:k])

    def accepted_path(self, tokens: Sequence[int]) -> list[int]:
        """Indices of the draft nodes a round accepted: ``tokens`` (the round's output, the last
        one the bonus token) followed down from the root, child by child."""
        path, node = [], 0
        for tok in tokens[:-1]:
            node = next(
                (
                    i
                    for i in range(node + 1, self.num_nodes)
                    if self.parents[i] == node and self.tokens[i] == tok
                ),
                -1,
            )
            if node < 0:
                break
            path.append(node)
        return path
