"""Grammar masks in the draft (issue 32): a constrained request's trees hold only tokens its
grammar allows along their paths, the same masks the target verifies them under
(`target_service.grammar`), so they can be accepted.

Per request the draft keeps one matcher (`DraftGrammars`), made at its starting extend from the
constraint (compiled once per draft, `runtime.grammar.Grammars`, with the target's tokenizer) and
advanced over the request's ids as extends commit them, mirroring the target's:

    request's ids:  prompt (image rows expanded) ... | output o0 o1 ... o_n | pending
                    0                     output_start                       consumed too

Ids before ``output_start`` are not the grammar's; every output id is consumed once, the pending
token included (the next extend's first id is that token again: skipped). A replay's context ends
with output emitted before it: consumed at its start, as the target's matcher does.

The search (`TreeDrafter.search`) carries each frontier node's state (`FrontierGrammar`): a copy
of its parent's that consumed the node's token. Before each top-k a node's draft logits are -inf
where its state forbids (the target-id mask mapped through the draft vocabulary, EAGLE-3
``d2t``), then log-softmaxed over what is left, so a forced token (a schema's punctuation) costs
its path nothing. A node with nothing allowed below it (EOS, or a draft vocabulary lacking every
allowed token) gets -inf children, never NaN; the tree is then cut to its nodes on the grammar
(`BatchGrammar.on_grammar`): every node of a proposed tree is one the target may accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.steps import ExtendInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.grammar import Grammars, allowed_rows, consume


@dataclass
class _Track:
    matcher: Any  # after every output id so far, the pending one included
    output_start: int  # index of the first output id in the request's ids
    seen: int  # the request's ids passed so far (committed ones and the pending one)
    pending: int


class DraftGrammars:
    """The matchers of a draft's constrained requests."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.tracks: dict[str, _Track] = {}

    def holds(self, rid: str) -> bool:
        return rid in self.tracks

    def advance(self, inp: ExtendInput) -> None:
        """Start a constrained request's matcher (its starting extend) or advance it over the
        output ids an extend commits and its pending token. InvalidRequestError when the
        constraint does not compile, comes after the start, or the ids leave the grammar."""
        if inp.constraint is not None and not inp.new:
            raise InvalidRequestError(
                f"request {inp.rid!r}: a constraint comes only with a request's starting extend"
            )
        if inp.new and inp.constraint is not None:
            if inp.output_start < 0:
                raise InvalidRequestError(f"output_start must be >= 0, got {inp.output_start}")
            matcher = self.grammars.compiled(inp.constraint).deep_copy()
            track, first = _Track(matcher, inp.output_start, 0, inp.next_token), 0
        elif (track := self.tracks.get(inp.rid)) is None:
            return
        elif inp.committed_ids[:1] != [track.pending]:
            raise InvalidRequestError(
                f"request {inp.rid!r}: extend starts with {inp.committed_ids[:1]}, not the "
                f"pending token {track.pending}"
            )
        else:
            first = track.seen - 1  # the index of its first id: the pending token
        ids = [*inp.committed_ids, inp.next_token]
        skip = max(track.seen, track.output_start) - first  # prompt ids, or consumed already
        consume(track.matcher, ids[max(skip, 0) :])
        track.seen, track.pending = first + len(ids), inp.next_token
        self.tracks[inp.rid] = track

    def batch(self, rids: list[str]) -> BatchGrammar | None:
        """What a propose call over ``rids`` masks by; None when none is constrained."""
        if not self.tracks:
            return None
        matchers = [t.matcher if (t := self.tracks.get(rid)) else None for rid in rids]
        if all(m is None for m in matchers):
            return None
        g = self.grammars
        return BatchGrammar(matchers, g.vocab_size, frozenset(g.eos_ids))

    def release(self, rid: str) -> None:
        self.tracks.pop(rid, None)


@dataclass(frozen=True)
class BatchGrammar:
    """The constrained requests of one propose call."""

    matchers: list[Any | None]  # per request: its matcher after its pending token; None: free
    vocab_size: int  # the target's: masks are over target ids
    eos_ids: frozenset[int]  # nothing follows them in a tree

    def frontier(self, target_ids: torch.Tensor) -> FrontierGrammar:
        """The roots' states; ``target_ids`` ``[draft_vocab]``: each draft id's target id."""
        cols = target_ids.cpu().numpy()
        in_vocab = (cols >= 0) & (cols < self.vocab_size)
        states = [None if m is None else [m] for m in self.matchers]
        return FrontierGrammar(self, cols.clip(0, self.vocab_size - 1), in_vocab, states)

    def on_grammar(self, trees: list[DraftTree]) -> list[DraftTree]:
        """Each constrained request's tree cut to its nodes on the grammar (`valid_nodes`)."""
        out = []
        for tree, matcher in zip(trees, self.matchers, strict=True):
            if matcher is not None:
                keep = valid_nodes(matcher, list(tree.tokens), list(tree.parents), self.eos_ids)
                tree = tree if all(keep) else subtree(tree, keep)
            out.append(tree)
        return out


@dataclass
class FrontierGrammar:
    """The grammar state after each frontier node's path, request by request: None for an
    unconstrained request; a node's None, nothing allowed below it."""

    batch: BatchGrammar
    cols: np.ndarray  # [draft_vocab] each draft id's target id (clipped into the vocab)
    in_vocab: np.ndarray  # [draft_vocab] bool: the target id exists
    states: list[list[Any | None] | None]

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[rows, draft_vocab]`` log-softmax of ``logits`` (rows: the frontier's nodes,
        request by request) over the tokens each node's state allows; -inf elsewhere, and on
        the whole row of a node with none."""
        n = logits.shape[0] // len(self.states)  # nodes per request
        rows = {b * n + i: s for b, nodes in enumerate(self.states) for i, s in
                enumerate(nodes or ())}  # fmt: skip
        live = [r for r, state in rows.items() if state is not None]
        allow = np.ones(logits.shape, dtype=np.bool_)  # [rows, draft_vocab], on the host
        allow[[r for r, state in rows.items() if state is None]] = False
        if live:
            target = allowed_rows([rows[r] for r in live], self.batch.vocab_size)  # [live, vocab]
            allow[live] = target[:, self.cols] & self.in_vocab
        forbid = torch.from_numpy(~allow).to(logits.device)
        logp = torch.log_softmax(logits.float().masked_fill(forbid, float("-inf")), -1)
        if not (some := allow.any(1)).all():  # a row with nothing allowed is -inf, not NaN
            logp[torch.from_numpy(~some).to(logits.device)] = float("-inf")
        return logp

    def descend(
        self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor
    ) -> FrontierGrammar:
        """The next frontier's states: node i of request b is a child of frontier node
        ``parents[b, i]`` with target token ``tokens[b, i]`` and path score ``scores[b, i]``
        (all ``[bs, k]``); a -inf score is a token off the grammar."""
        par, tok, ok = parents.tolist(), tokens.tolist(), torch.isfinite(scores).tolist()
        states = [
            None if nodes is None else [self._child(nodes[p], t, f) for p, t, f in
                                        zip(par[b], tok[b], ok[b], strict=True)]
            for b, nodes in enumerate(self.states)
        ]  # fmt: skip
        return FrontierGrammar(self.batch, self.cols, self.in_vocab, states)

    def _child(self, parent: Any | None, token: int, finite: bool) -> Any | None:
        if parent is None or not finite or token in self.batch.eos_ids:
            return None
        state = parent.deep_copy()
        return state if state.consume_token(token) else None


def valid_nodes(
    matcher: Any, tokens: list[int], parents: list[int], eos_ids: frozenset[int]
) -> list[bool]:
    """Per tree node: whether the grammar allows its token after its path (node 0, the root,
    is already consumed by ``matcher``, which is not changed); nothing follows an EOS."""
    states: list[Any] = [matcher] + [None] * (len(tokens) - 1)
    keep = [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):  # parents come before children
        parent = states[parents[i]]
        if parent is None:
            continue
        state = parent.deep_copy()
        if state.consume_token(tokens[i]):
            keep[i] = True
            states[i] = None if tokens[i] in eos_ids else state
    return keep


def subtree(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The nodes of ``tree`` that ``keep`` says, the root and every kept node's parent among
    them, renumbered in order."""
    index = {old: new for new, old in enumerate(i for i, k in enumerate(keep) if k)}
    tokens, parents = tree.tokens, tree.parents
    kept = list(index)
    return DraftTree.of(
        [tokens[i] for i in kept], [-1 if i == 0 else index[parents[i]] for i in kept]
    )
