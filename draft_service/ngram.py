"""N-gram drafting (prompt lookup): no model, no KV, no target features.

Per request the drafter keeps the token history (every committed id, then the pending token).
To propose, it looks for earlier occurrences of the history's last n tokens, n = 3, 2, 1, most
recent first, and proposes the tokens that followed them:

    history:  ... a b c d e ... a b c | (pending = c)     suffix "a b c" matched earlier
    tree:     root(c) -> d -> e -> ...                   a chain of up to num_draft_tokens - 1

A continuation that reaches the end of the history goes on with its own tokens, so a repeating
pattern (``x y x y x y``) is proposed for the whole chain, not just up to the history's end.

With ``topk > 1`` the root gets up to ``topk`` children: the first tokens of distinct
continuations from different earlier occurrences (longer matches first, then more recent). Every
branch keeps its first token; the remaining node budget extends the branches as chains, best
branch first, for at most ``num_draft_tokens`` nodes in all. No match: the tree is the root alone
and the target decodes one token. A constrained request's tree is cut where its grammar refuses
a token (`specmesh.draft_service.grammar`).
"""

from __future__ import annotations

import torch

from specmesh.draft_service.grammar import BatchGrammar
from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import InvalidRequestError, UnknownRequestError
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.steps import ExtendInput
from specmesh.protocol.trees import DraftTree

MAX_NGRAM = 3


class NgramDrafter:
    needs = FeatureSpec()

    def __init__(self, spec: SpecParams) -> None:
        spec.validate()
        self.spec = spec
        self.history: dict[str, list[int]] = {}  # committed ids
        self.pending: dict[str, int] = {}

    def check_context(self, rid: str, num_new_tokens: int) -> None:
        """No KV cache, no context limit."""

    def extend(self, inputs: list[ExtendInput]) -> None:
        for inp in inputs:  # every check before any change
            if inp.is_multimodal:  # placeholder ids are no text to look up (invariant 1)
                raise InvalidRequestError(
                    f"request {inp.rid!r}: the n-gram draft does not look up image placeholders"
                )
        for inp in inputs:
            if inp.new:
                self.history[inp.rid] = []
            self._get(inp.rid).extend(inp.committed_ids)
            self.pending[inp.rid] = inp.next_token

    def propose(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None = None
    ) -> list[DraftTree]:
        """``grammar``: a constrained request's tree is cut to the nodes its grammar allows."""
        trees = [
            self._propose_one([*self._get(r), root]) for r, root in zip(rids, roots, strict=True)
        ]
        return trees if grammar is None else grammar.on_grammar(trees)

    def _propose_one(self, seq: list[int]) -> DraftTree:
        budget = self.spec.num_draft_tokens - 1
        branches = find_continuations(seq, min(self.spec.topk, budget), budget)
        tokens = [seq[-1], *(branch[0] for branch in branches)]
        parents = [-1] + [0] * len(branches)
        for b, branch in enumerate(branches):
            parent = 1 + b
            for tok in branch[1 : 1 + budget - (len(tokens) - 1)]:
                tokens.append(tok)
                parents.append(parent)
                parent = len(tokens) - 1
        return DraftTree.of(tokens, parents)

    def _get(self, rid: str) -> list[int]:
        if rid not in self.history:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        return self.history[rid]

    def release(self, rid: str) -> None:
        self._get(rid)
        del self.history[rid]
        self.pending.pop(rid, None)


def find_continuations(seq: list[int], max_branches: int, max_len: int) -> list[list[int]]:
    """Up to ``max_branches`` continuations (each at most ``max_len`` tokens, distinct first
    tokens) of the longest suffix of ``seq`` that occurred before: n = 3, 2, 1, most recent
    occurrence first."""
    t = torch.tensor(seq, dtype=torch.int64)
    out: list[list[int]] = []
    firsts: set[int] = set()
    for n in range(min(MAX_NGRAM, len(seq) - 1), 0, -1):
        windows = t[:-1].unfold(0, n, 1)  # [len - n, n]: windows followed by >= 1 token
        hits = (windows == t[-n:]).all(dim=1).nonzero().flatten().tolist()
        for i in reversed(hits):
            follow = continuation(seq, i + n, max_len)
            if follow[0] not in firsts:
                firsts.add(follow[0])
                out.append(follow)
                if len(out) == max_branches:
                    return out
    return out


def continuation(seq: list[int], start: int, max_len: int) -> list[int]:
    """``seq[start:]`` as a prediction of what follows ``seq``; where it runs past the end it
    continues with its own predictions (a repeating pattern keeps repeating)."""
    out: list[int] = []
    for src in range(start, start + max_len):
        out.append(seq[src] if src < len(seq) else out[src - len(seq)])
    return out
