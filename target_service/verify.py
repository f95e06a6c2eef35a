"""Tree verification on the target: every request's tree forwarded in one batch (prefix +
ancestors + self mask, positions ``committed + depth``), a path of each accepted greedily or by
lossless tree sampling (`acceptance`), and the path's KV kept by length (rollback is the KV
cache's `accept_paths`). Plain decoding is the one-node tree. The runtime owns every request's
state; these functions only read and advance it through the runtime."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specmesh.protocol.errors import InvalidRequestError, KVCacheFullError, SpecmeshError
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.sampling import TokenHistory
from specmesh.target_service.acceptance import accept_trees
from specmesh.target_service.batching import ordered_outputs, pick_logprobs, run_isolated

if TYPE_CHECKING:
    from specmesh.runtime.models.causal_lm import ModelOutput
    from specmesh.target_service.runtime import TargetRuntime


@dataclass(frozen=True)
class Tree:
    """A draft tree as the target verifies it: tokens and parent indices, node 0 the root,
    and what is derived from them (depths, the ancestor mask, first-child / next-sibling links),
    built and validated once (`from_parents`), so a tree from the wire cannot disagree with
    itself. What the forward reads is a tensor (one per field); what the acceptance reads stays
    host ints, joined into one tensor for the batch (`acceptance.accept_trees`)."""

    tokens: torch.Tensor  # [N] int64, tokens[0] is the root (the request's pending token)
    depths: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [N, N] bool, i sees j iff j is an ancestor of i or j == i
    ids: tuple[int, ...]  # the tokens as host ints
    parents: tuple[int, ...]  # parents[0] == -1, parents[i] < i
    levels: tuple[int, ...]  # the depths as host ints
    first_child: tuple[int, ...]  # -1 for a leaf
    next_sibling: tuple[int, ...]  # -1 for the last child

    @property
    def num_nodes(self) -> int:
        return len(self.ids)

    @staticmethod
    def from_parents(
        tokens: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor
    ) -> Tree:
        ids = tuple(int(t) for t in tokens)
        par = tuple(int(p) for p in parents)
        n = len(par)
        if n == 0 or len(ids) != n:
            raise InvalidRequestError(f"tree has {len(ids)} tokens and {n} parents")
        if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
            raise InvalidRequestError(
                f"tree parents must be -1 for node 0 and < i for node i: {list(par)}"
            )
        # Host lists and numpy first, tensors over them at the end: a tree is small, a torch op
        # per node is not. Row i of the mask is node i itself or'd with its parent's row.
        depths, mask = [0] * n, np.eye(n, dtype=bool)
        first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
        for i in range(1, n):
            p = par[i]
            depths[i] = depths[p] + 1
            mask[i] |= mask[p]
            if first_child[p] < 0:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        return Tree(
            _host_tensor(ids), _host_tensor(depths), torch.from_numpy(mask),
            ids, par, tuple(depths), tuple(first_child), tuple(next_sibling),
        )  # fmt: skip

    @staticmethod
    def chain(tokens: list[int]) -> Tree:
        return Tree.from_parents(tokens, list(range(-1, len(tokens) - 1)))


def _host_tensor(xs: Sequence[int]) -> torch.Tensor:
    """An int64 tensor over host ints (through numpy: a third of ``torch.tensor``'s time)."""
    return torch.from_numpy(np.array(xs, dtype=np.int64))


@dataclass
class VerifyRow:
    """One tree with its request's sampling state (`accept_trees` reads these fields)."""

    rid: str
    tree: Tree
    params: SamplingParams
    sample_offset: int
    history: TokenHistory | None = None
    grammar: Any = None  # the request's matcher (constrained requests): masks every node
    item: BatchItem | None = None  # the forward's row (set once the tree fits the KV cache)


def verify_trees(
    rt: TargetRuntime, inputs: list[VerifyInput], feature: Feature = Feature.NONE
) -> StepOutput:
    """Forward every tree (prefix + ancestors + self mask, positions ``committed + depth``),
    accept a path greedily or by lossless tree sampling, keep the path's KV by length.
    A request that is invalid or whose tree does not fit in the KV cache fails alone and
    is dropped. Requests whose step already ran ahead (`run_ahead`) are only kept; the rest of
    the batch runs, and the rows come back in the batch's order."""
    hits = rt.ahead.take(rt, inputs, feature) if rt.ahead.ready else {}
    rest = [i for i in inputs if i.rid not in hits]
    rows, errors = verify_rows(rt, rest, rt.release)
    out = run_isolated(rows, lambda b: keep(rt, feature, *decide(rt, b, feature)), rt.release)
    out.errors.update(errors)
    if not hits:
        return out
    ahead = [i for i in inputs if i.rid in hits]
    kept = keep(rt, feature, [hits[i.rid] for i in ahead])
    return ordered_outputs([(ahead, kept), (rest, out)], [i.rid for i in inputs])


def verify_rows(
    rt: TargetRuntime, inputs: list[VerifyInput], on_error: Callable[[str], object]
) -> tuple[list[VerifyRow], dict[str, SpecmeshError]]:
    """Each input's row, checked and fitted into the KV cache; or its error, after which
    ``on_error(rid)`` runs (the verify drops the request; a run-ahead leaves it be)."""
    errors: dict[str, SpecmeshError] = {}
    rows, pages = [], 0  # the pages the rows so far need beyond what they hold
    for inp in inputs:
        try:
            row = _verify_row(rt, inp)
            row.item, need = _verify_item(rt, row, pages)
        except SpecmeshError as e:
            errors[inp.rid] = e
            on_error(inp.rid)
            continue
        pages += need
        rows.append(row)
    return rows, errors


def _verify_row(rt: TargetRuntime, inp: VerifyInput) -> VerifyRow:
    req = rt._get(inp.rid)
    tokens = list(inp.tree.tokens)
    if not tokens or tokens[0] != req.pending:
        raise InvalidRequestError(
            f"request {inp.rid!r}: tree root {tokens[0]} is not the pending token {req.pending}"
        )
    rt.check_ids(inp.rid, tokens, what="draft tree")
    tree = tree_of(inp.tree)
    return VerifyRow(inp.rid, tree, req.params, req.next_offset, req.history, req.grammar)


def _verify_item(rt: TargetRuntime, row: VerifyRow, pages: int) -> tuple[BatchItem, int]:
    """The row's forward item and the KV pages it needs, if they fit beside ``pages`` more
    for the rows before it (each row's own count: the check stays linear in the batch)."""
    base = rt.cache.get(row.rid).committed_len
    n = row.tree.num_nodes
    need = rt.cache.pages_needed(row.rid, base + n)
    if not rt.cache.can_take(pages + need):
        raise KVCacheFullError(
            f"request {row.rid!r}: a {n}-node tree does not fit; {rt.cache.num_free_slots} KV slots free"
        )
    if n == 1:  # plain decode sees its whole prefix: causal, the decode graph's mode
        return BatchItem(row.rid, row.tree.tokens, base), need
    mask = np.ones((n, base + n), dtype=bool)  # the prefix, then the tree's ancestors
    mask[:, base:] = row.tree.mask.numpy()
    item = BatchItem(row.rid, row.tree.tokens, base, base + row.tree.depths, torch.from_numpy(mask))
    return item, need


@dataclass
class Decided:
    """One request's verify, decided and not yet kept: the accepted path (node indices, root
    first) and its tokens, the tokens it yields (the accepted children, then the bonus), their
    logprobs when asked, and the path's feature rows."""

    row: VerifyRow
    path: list[int]
    path_ids: list[int]
    tokens: list[int]
    features: torch.Tensor | None
    logprobs: list[Logprob] | None = None


def decide(
    rt: TargetRuntime, rows: list[VerifyRow], feature: Feature
) -> tuple[list[Decided], torch.Tensor | None]:
    """Forward the rows' trees and choose each one's path and bonus; no request's state
    changes (the KV written for the trees stays uncommitted). Also the chosen paths' feature
    rows, flat in row order."""
    items = [r.item for r in rows]
    runner = rt.graphs.runner_for(items) if rt.graphs is not None else None
    if runner is not None:  # a CUDA graph of this batch's shape
        res = runner.run(items)
    else:
        res = run_batch(rt.model, rt.cache, rt.backend, items)
    # A target graph's replay computed the logits and their argmax (`CausalLM.head_outputs`).
    logits = rt.model.compute_logits(res.hidden) if res.logits is None else res.logits
    if all(r.tree.num_nodes == 1 and _plain_greedy(r.params) for r in rows):
        # Plain greedy decoding (every tree is its root alone): the tree verifier would pick the
        # argmax and keep the one row, so do just that. The features are a copy: a graph
        # replay's outputs are overwritten.
        feats = rt.select_feature(res, feature)
        feats = None if feats is None else feats.clone()
        return [
            Decided(row, [0], [rt.requests[row.rid].pending], [tok], _rows(feats, b, 1))
            for b, (row, tok) in enumerate(zip(rows, _argmax(res, logits).tolist(), strict=True))
        ], feats
    n_max = max(r.tree.num_nodes for r in rows)
    acceptance = accept_trees(rows, logits, n_max, rt.kernel_impl)
    result = acceptance.result
    # One device-to-host copy for the batch (each row's path, its length, its bonus token);
    # the per-request bookkeeping below is host-side, and so are the accepted rows' indices.
    fields = (result.accept_path, result.accept_len[:, None], result.bonus[:, None])
    host = torch.cat([f.to(torch.int64) for f in fields], 1).tolist()
    paths = [h[: h[-2]] for h in host]
    feats = rt.select_feature(res, feature)
    if feats is not None:  # the paths' rows, flat in row order: one index copy to the device
        kept = [row0 + i for row0, path in zip(_starts(rows), paths, strict=True) for i in path]
        feats = feats[torch.tensor(kept, device=feats.device)]
    decided, start = [], 0
    for b, (row, path, h) in enumerate(zip(rows, paths, host, strict=True)):
        n, bonus = len(path), h[-1]
        path_ids = [row.tree.ids[i] for i in path]
        tokens = [*path_ids[1:], bonus]
        d = Decided(row, path, path_ids, tokens, _rows(feats, start, n))
        if row.params.logprobs is not None:  # node path[k]'s row drew tokens[k]
            lp = acceptance.logprobs[b, torch.tensor(path, device=acceptance.logprobs.device)]
            d.logprobs = pick_logprobs(lp, tokens, row.params.logprobs)
        decided.append(d)
        start += n
    return decided, feats


def _argmax(res: ModelOutput, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) if res.greedy is None else res.greedy


def keep(
    rt: TargetRuntime,
    feature: Feature,
    decided: list[Decided],
    features: torch.Tensor | None = None,
) -> StepOutput:
    """Commit each decided path (its KV, the prefix cache's blocks, the request's tokens).
    ``features`` are the paths' rows flat in order, or None to gather them here."""
    if features is None and decided and decided[0].features is not None:
        features = torch.cat([d.features for d in decided])
    out, key = StepOutput(features=features), rt.feature_key(feature)
    trees = [(d.row.rid, d.path, d.row.tree.num_nodes) for d in decided]
    rt.cache.accept_paths([t for t in trees if t[2] > 1])
    for d in decided:
        rid = d.row.rid
        if d.row.tree.num_nodes == 1:
            rt.cache.commit(rid, rt.cache.get(rid).committed_len + 1)
        rt.prefixes.extend(rid, d.path_ids, d.features, key)
        if d.logprobs is not None:
            out.logprobs[rid] = d.logprobs
        rt.advance(rid, d.tokens, out)
    return out


def _starts(rows: list[VerifyRow]) -> list[int]:
    """Each tree's first row in the forward's flat output."""
    return [0, *itertools.accumulate(r.tree.num_nodes for r in rows)][:-1]


def _rows(feats: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if feats is None else feats[start : start + n]


@functools.lru_cache(maxsize=4096)
def one_node_tree(token: int) -> Tree:
    """The tree plain decoding verifies: the pending token alone. Shared between requests and
    steps (a `Tree` is never written to), so a decode step builds no tensors per request."""
    return Tree.chain([token])


def tree_of(draft: DraftTree) -> Tree:
    """The tree as the target verifies it: its derived fields (depths, ancestor mask, sibling
    links) built and checked here, once; a bare root comes from `one_node_tree`."""
    if draft.num_nodes == 1:
        return one_node_tree(draft.tokens[0])
    return Tree.from_parents(draft.tokens, draft.parents)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy on the raw logits with nothing else to compute: the fast decode path."""
    plain = not params.uses_history and params.logprobs is None and params.constraint is None
    return params.greedy and plain
