"""Pre-drafting: while the target verifies a request's tree, its draft prepares the next tree
for the verify's most likely outcomes, so that the next extend that matches one is answered at
once and the draft's work leaves the round's critical path.

An outcome of verifying tree T is the accepted path (ending at node j) and the bonus token b:
the router's next extend then carries committed ids ``[root, path(j)...]`` and next token b. The
draft scores it with its own distributions, ``P(reach j) * q(b | j)`` (the search's cumulative
log-probability of j plus log q), for b not among j's children in T (those the target would have
accepted). The best ``num_outcomes`` are grown into whole trees, in KV regions past T's:

    draft KV row: [ prefix | T's nodes (W) | outcome 0: b row, subtree | outcome 1: ... ]
                           ^ spec_base

b's row sees the prefix, j's forwarded ancestors and j (their KV is the search's that built T)
and takes j's output as its input hidden (EAGLE's own-feature step, as within a search); its
subtree is searched like any tree (`TreeDrafter.search`, seeing the same rows). Only forwarded
nodes (and the root) can end an outcome: the search's deepest layer is never forwarded.

None of this needs to be exact: the target verifies every proposal (lossless, token-exact). A
hit's state is made right before the next search uses it:

  1. the extend runs as usual over the committed ids with the target's features, so the prefix
     is exact again; it writes at most ``num_steps + 2`` rows from spec_base, never reaching the
     outcome regions (W is at least that);
  2. the hit outcome's subtree moves to T's region by permuting slot ids (`KVCache.move_entries`,
     no K/V copy), so its forwarded nodes sit where a search would have put them, and their
     records (KV indices, outputs) are what the next outcomes grow from.

The hit tree's own nodes keep the KV they were grown with (they saw the guessed path rows, not
the exact ones); every row below them is exact. Outcomes that do not fit the request's context or
the free KV are simply not drafted: pre-drafting never fails a request.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from specmesh.draft_service.drafter import RootState, TreeDrafter
from specmesh.draft_service.grammar import BatchGrammar
from specmesh.draft_service.node_records import EXTRA_CANDIDATES, NodeRecord, Records
from specmesh.protocol.steps import ExtendInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.model_runner import BatchItem

log = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], int]  # (committed ids of the next extend, its next token)
MAX_TREES = 8  # outcome trees one pre-draft grows for a whole batch, at most


@dataclass
class Outcome:
    tree: DraftTree  # rooted at the guessed bonus token
    records: Records  # its forwarded nodes, KV indices in its own region
    region: int  # KV token index of its subtree's first node (its b row is ``region - 1``)
    version: int = 0  # the draft weights' version it was drafted with (online learning)


@dataclass
class _Guess:
    rid: str
    key: Key
    node: NodeRecord  # j, where the accepted path ends
    bonus: int
    base: int  # KV token index of b's row


class PreDrafter:
    def __init__(self, drafter: TreeDrafter, num_outcomes: int, num_steps: int) -> None:
        self.drafter, self.num_outcomes = drafter, num_outcomes
        self.num_steps = min(num_steps, drafter.spec.num_steps)  # of each outcome's search
        spec = drafter.spec
        self.subtree = spec.topk * (spec.num_steps - 1)  # forwarded nodes of one search
        # W (module docstring): T's search nodes, then its leaves (forwarded by `predraft`)
        self.tree_width = max(self.subtree + spec.num_draft_tokens - 1, spec.num_steps + 2)
        self.trees: dict[str, tuple[DraftTree, Records]] = {}  # the tree each request last answered
        self.outcomes: dict[str, dict[Key, Outcome]] = {}
        self.num_drafted = self.num_hits = self.num_taken = 0  # counters, for metrics
        self.version = 0  # the weights' version pre-drafts run (the runtime's learner sets it)

    # -- the request's answered tree ---------------------------------------------------------------
    def propose(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None = None
    ) -> list[DraftTree]:
        """`TreeDrafter.propose`, keeping each tree's forwarded nodes to pre-draft from (the
        runtime pre-drafts no constrained request: its outcomes would need grammar states)."""
        d = self.drafter
        states = [d.roots[r] for r in rids]
        trees, records = d.search(rids, states, roots, record=True, grammar=grammar)
        for rid, tree, rec in zip(rids, trees, records or (), strict=True):
            self.trees[rid] = (tree, rec)
        return trees

    def take(self, inp: ExtendInput) -> Outcome | None:
        """The outcome an extend of ``inp``'s request hits, if any; every other outcome of the
        request (and its answered tree) is forgotten: the extend makes them stale."""
        self.trees.pop(inp.rid, None)
        outcomes = self.outcomes.pop(inp.rid, None)
        if outcomes is None:
            return None
        self.num_taken += 1
        hit = outcomes.get((tuple(inp.committed_ids), inp.next_token))
        self.num_hits += hit is not None
        return hit

    def adopt(self, rid: str, outcome: Outcome) -> None:
        """After the hit's extend: the outcome's subtree moves to T's region and becomes the
        request's answered tree (module docstring, step 2)."""
        st = self.drafter.roots[rid]
        self.drafter.cache.move_entries(rid, outcome.region, st.spec_base, self.subtree)
        shift = st.spec_base - outcome.region
        records = {(): self._root(st)}
        for path, r in outcome.records.items():
            if path:
                records[path] = NodeRecord(
                    r.kv + shift, [a + shift for a in r.ancestors], r.position, r.hidden,
                    r.cand_ids, r.cand_logp, r.score,
                )  # fmt: skip
        self.trees[rid] = (outcome.tree, records)

    def _root(self, st: RootState) -> NodeRecord:
        """The root's record from the request's (exact) state after the extend."""
        k = self.drafter.spec.topk
        logp = torch.log_softmax(st.logits.float(), -1)
        cand_logp, cand_ids = logp.topk(min(k + EXTRA_CANDIDATES, logp.numel()))
        ids = self.drafter.to_target_ids(cand_ids).tolist()
        return NodeRecord(None, [], st.last_pos, st.hidden, ids, cand_logp.tolist(), 0.0)

    def release(self, rid: str) -> None:
        self.trees.pop(rid, None)
        self.outcomes.pop(rid, None)

    # -- pre-draft ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def predraft(self, rids: list[str]) -> None:
        """Grow the best outcomes of each request's answered tree (a request whose outcomes do
        not fit gets none)."""
        rids = [rid for rid in rids if rid in self.trees and self._reserve(rid)]
        self._forward_leaves(rids)
        # the batch's trees are bounded, not each request's: a pre-draft costs about one search
        per_request = max(1, min(self.num_outcomes, MAX_TREES // max(len(rids), 1)))
        guesses = [g for rid in rids for g in self._placed(rid)[:per_request]]
        if not guesses:
            return
        states = self._grow_roots(guesses)
        trees, records = self.drafter.search(
            [g.rid for g in guesses], states, [g.bonus for g in guesses], record=True, eager=True,
            num_steps=self.num_steps,
        )  # fmt: skip
        for g, tree, rec in zip(guesses, trees, records or (), strict=True):
            outcome = Outcome(tree, rec, g.base + 1, self.version)
            self.outcomes.setdefault(g.rid, {})[g.key] = outcome
        self.num_drafted += len(guesses)

    def _reserve(self, rid: str) -> bool:
        """Whether the request's tree leaves and outcomes fit its context and the free KV (then
        its slots for them are taken)."""
        cache = self.drafter.cache
        end = self.drafter.roots[rid].spec_base + self.tree_width
        end += self.num_outcomes * (1 + self.subtree)
        if end > cache.max_context or not cache.can_allocate({rid: end}):
            return False
        cache.reserve(rid, end)
        return True

    def _placed(self, rid: str) -> list[_Guess]:
        """The request's best outcomes, each with its KV region."""
        first = self.drafter.roots[rid].spec_base + self.tree_width
        return [
            _Guess(rid, key, node, bonus, first + i * (1 + self.subtree))
            for i, (key, node, bonus) in enumerate(self._best(rid))
        ]

    def _forward_leaves(self, rids: list[str]) -> None:
        """Forward the tree nodes the search never did (its deepest layer): a path that the
        target accepts to the end is an outcome too. Each sees the prefix, its ancestors and
        itself; its record joins the tree's."""
        d, items, hidden_in, born = self.drafter, [], [], []
        for rid in rids:
            tree, records = self.trees[rid]
            leaves = _unforwarded(tree, records)
            if not leaves:
                continue
            prefix, start = d.roots[rid].spec_base, d.roots[rid].spec_base + self.subtree
            mask = torch.zeros(len(leaves), start + len(leaves), dtype=torch.bool)
            mask[:, :prefix] = True
            for row, (_, _, parent) in enumerate(leaves):
                mask[row, [*parent.ancestors, *_own(parent), start + row]] = True
            tokens = torch.tensor([path[-1] for path, _, _ in leaves], dtype=torch.int64)
            positions = torch.tensor([parent.position + 1 for _, _, parent in leaves])
            items.append(BatchItem(rid, tokens, start, positions, mask))
            hidden_in += [parent.hidden for _, _, parent in leaves]
            born += [(records, start + row, leaf) for row, leaf in enumerate(leaves)]
        if not items:
            return
        hidden, logits = d.step_forward(1, items, torch.stack(hidden_in))
        cand_logp, cand_ids = torch.log_softmax(logits.float(), -1).topk(d.spec.topk + 2)
        cand_ids = d.to_target_ids(cand_ids).tolist()
        for row, (records, kv, (path, score, parent)) in enumerate(born):
            records[path] = NodeRecord(
                kv, [*parent.ancestors, *_own(parent)], parent.position + 1, hidden[row],
                cand_ids[row], cand_logp[row].tolist(), score,
            )  # fmt: skip

    def _best(self, rid: str) -> list[tuple[Key, NodeRecord, int]]:
        """The ``num_outcomes`` likeliest (path end, bonus) pairs of the request's tree."""
        tree, records = self.trees[rid]
        tokens, parents = tree.tokens, tree.parents
        paths: list[tuple[int, ...]] = [()]
        children: dict[int, set[int]] = defaultdict(set)
        for i in range(1, len(tokens)):
            paths.append((*paths[parents[i]], tokens[i]))
            children[parents[i]].add(tokens[i])
        scored = [
            (node.score + logp, (tokens[0], *paths[i]), node, bonus)
            for i in range(len(tokens))
            if (node := records.get(paths[i])) is not None
            for bonus, logp in zip(node.cand_ids, node.cand_logp, strict=True)
            if bonus not in children[i]
        ]
        best = heapq.nlargest(self.num_outcomes, scored, key=lambda s: s[0])
        return [((ids, bonus), node, bonus) for _, ids, node, bonus in best]

    def _grow_roots(self, guesses: list[_Guess]) -> list[RootState]:
        """One forward of every guessed bonus as a child of its path's end: each outcome's root
        state (its row's output and logits)."""
        d = self.drafter
        items = []
        for g in guesses:
            prefix = d.roots[g.rid].spec_base
            seen = [*g.node.ancestors, *(() if g.node.kv is None else (g.node.kv,))]
            mask = torch.zeros(1, g.base + 1, dtype=torch.bool)
            mask[0, :prefix] = True
            mask[0, [*seen, g.base]] = True
            token = torch.tensor([g.bonus], dtype=torch.int64)
            items.append(BatchItem(g.rid, token, g.base, torch.tensor([g.node.position + 1]), mask))
        hidden, logits = d.step_forward(1, items, torch.stack([g.node.hidden for g in guesses]))
        states = []
        for i, g in enumerate(guesses):
            seen = (*g.node.ancestors, *(() if g.node.kv is None else (g.node.kv,)), g.base)
            prefix = d.roots[g.rid].spec_base
            states.append(
                RootState(g.node.position + 1, g.base + 1, hidden[i], logits[i], prefix, seen)
            )
        return states


def _own(node: NodeRecord) -> tuple[int, ...]:
    """The node's own KV row, as an ancestor of its children (none for the root)."""
    return () if node.kv is None else (node.kv,)


def _unforwarded(
    tree: DraftTree, records: Records
) -> list[tuple[tuple[int, ...], float, NodeRecord]]:
    """(path, score, parent's record) of each tree node without a record whose parent has one."""
    tokens, parents = tree.tokens, tree.parents
    paths: list[tuple[int, ...]] = [()]
    out = []
    for i in range(1, len(tokens)):
        paths.append((*paths[parents[i]], tokens[i]))
        parent = records.get(paths[parents[i]])
        if paths[i] not in records and parent is not None and tokens[i] in parent.cand_ids:
            logp = parent.cand_logp[parent.cand_ids.index(tokens[i])]
            out.append((paths[i], parent.score + logp, parent))
    return out
