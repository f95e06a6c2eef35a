"""Tree drafting over a draft network with its own paged KV cache.

Per request the drafter keeps the state of its last extend row ("the root's row"):

    draft KV row: [ committed rows 0 .. C-1 | root row (standalone only) | step 1 nodes | step 2 ... ]
                                            ^ spec_base: speculative nodes start here

EAGLE-style drafts commit every extend row (row p pairs target feature p with token p + 1, so the
last row already encodes the root). The standalone draft forwards the root as an uncommitted row.
Either way the root's children are the top-k of the last row's logits, and a node at depth j has
position ``last_pos + j``. Speculative rows are overwritten by the next extend: rollback moves no
KV.

Proposing runs ``num_steps - 1`` forwards of ``topk`` frontier nodes per request, each seeing the
prefix plus its own ancestors (tree mask), expands every frontier node to ``topk`` children scored
by cumulative log-probability, keeps the best ``topk`` as the next frontier, and reranks the whole
pool to ``num_draft_tokens - 1`` nodes (`specmesh.kernels.tree_build.select_tree`). A constrained request's
nodes are masked by its grammar before each top-k (`specmesh.draft_service.grammar`).

What a frontier node sees of the speculative region is one device tensor for the batch,
``seen [bs, topk, S]`` (S = topk * (num_steps - 1) columns, column c = KV token index
``spec_base + c``): its forwarded ancestors and itself. A step marks the frontier's own columns,
forwards, and the next frontier takes its parents' rows: no per-node Python, and nothing read
back to the host until the finished trees. Through the static-shape runners
(`specmesh.draft_service.step_batch`) a step writes only its tokens, positions, KV slots, input
hidden and those columns of the mask; everything else is laid out once per search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specmesh.draft_service.node_records import (
    EXTRA_CANDIDATES,
    Records,
    record_frontier,
    root_record,
)
from specmesh.draft_service.prefix_rows import DraftPrefixes
from specmesh.kernels.tree_build import select_tree
from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import KVCacheFullError
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.layers import KVPair
from specmesh.runtime.models.moe import stack_experts
from specmesh.runtime.static_shapes import DraftSizes

if TYPE_CHECKING:
    from specmesh.draft_service.grammar import BatchGrammar, FrontierGrammar
    from specmesh.draft_service.search_graph import SearchGraphs
    from specmesh.draft_service.step_graphs import DraftStepGraphs

# forward(step, frontier tokens [bs, k], input hidden [bs * k, H], seen [bs, k, S]) -> (hidden
# out [bs * k, H], logits [bs * k, draft_vocab])
StepForward = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class RootState:
    """A request's drafting state after its last extend."""

    last_pos: int  # position of the root's row
    spec_base: int  # KV token index where speculative nodes start
    hidden: torch.Tensor  # [hidden], the root row's output, input of its children's forward
    logits: torch.Tensor  # [draft_vocab], the root row's logits
    # What every node of the tree sees besides its own ancestors: KV token indices ``[0,
    # prefix_len)`` (default: ``spec_base``) and ``visible``. A pre-drafted outcome's tree
    # (`specmesh.draft_service.predraft`) sees the prefix and the guessed path above its root.
    prefix_len: int | None = None
    visible: tuple[int, ...] = ()


class TreeDrafter:
    """Generic tree search; subclasses say how a step forwards (`step_forward`) and which KV
    pool each step uses (`pools_for_step`, explicit so multi-layer drafts cannot share one)."""

    supports_predraft = True  # one network for every step (`specmesh.draft_service.predraft`)
    prefix_lookahead = 1  # tokens past its position a row depends on (`prefix_rows`)

    def __init__(self, cache: KVCache, backend: AttentionBackend, spec: SpecParams) -> None:
        spec.validate()
        self.cache, self.backend, self.spec = cache, backend, spec
        self.sizes = DraftSizes(
            cache.req_to_slot.shape[0], spec.topk, spec.num_steps, cache.max_context
        )
        self.roots: dict[str, RootState] = {}
        self.step_graphs: DraftStepGraphs | None = None  # see enable_step_graphs
        self.search_graphs: SearchGraphs | None = None
        self.prefixes: DraftPrefixes | None = None  # see enable_prefix_cache

    def enable_prefix_cache(self, max_tokens: int, block_size: int) -> None:
        """Reuse the rows of prompt prefixes an earlier request extended over."""
        lookahead = self.prefix_lookahead
        self.prefixes = DraftPrefixes(self.cache, block_size, max_tokens, lookahead=lookahead)

    def release(self, rid: str) -> None:
        """Free ``rid``'s row, then its prefix references (`KVCache.release` keeps the order)."""
        self.cache.release(rid)
        self.roots.pop(rid, None)

    def enable_step_graphs(self, mode: str, max_bs: int, *, extend: bool = True) -> None:
        """Run decode steps through static-shape runners (``"cuda-graph"``: captured now, before
        the service reports ready; ``"eager-static"``: the same buffers, run eagerly), and with
        ``extend`` the extends of drafters that have an extend runner."""
        from specmesh.draft_service.search_graph import SearchGraphs
        from specmesh.draft_service.step_graphs import DraftStepGraphs

        # A mixture of experts in a network this drafter holds (an MTP layer) reads only its
        # chosen experts once captured.
        stack_experts(*[v for v in vars(self).values() if isinstance(v, torch.nn.Module)])
        if self.spec.num_steps > 1:
            self.step_graphs = DraftStepGraphs(self, mode=mode, max_bs=max_bs)
            if mode == "eager-static" or not self.backend.needs_cpu_metadata:
                self.search_graphs = SearchGraphs(self, self.step_graphs, mode)

    def check_context(self, rid: str, num_new_tokens: int) -> None:
        """Raise unless ``rid`` fits ``num_new_tokens`` more committed tokens plus one tree on
        top (``topk`` KV tokens per decode step after the first) in ``max_context``. Checked per
        request before any forward: an over-limit request fails alone, not its whole batch."""
        held = self.cache.requests.get(rid)
        committed = (held.committed_len if held is not None else 0) + num_new_tokens
        tree = self.spec.topk * (self.spec.num_steps - 1)
        if committed + tree > self.cache.max_context:
            raise KVCacheFullError(
                f"request {rid!r} needs {committed + tree} draft tokens ({committed} committed + "
                f"{tree} for a tree of {self.spec.num_steps} steps x topk {self.spec.topk}), "
                f"above the draft's max_context {self.cache.max_context}"
            )

    # -- hooks ---------------------------------------------------------------------------------
    def pools_for_step(self, step: int) -> list[KVPair]:
        return self.cache.pools

    def step_forward(
        self, step: int, items: list[BatchItem], hidden_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``items`` at draft step ``step``; returns (hidden_out [rows, H], logits
        [rows, draft_vocab])."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def position_offset(self, step: int) -> int:
        """A node forwarded at ``step`` has position ``last_pos + position_offset(step)``."""
        return step

    def prefix_columns(self, step: int, st: RootState, width: int) -> np.ndarray:
        """``[width]`` bool: the KV token indices below ``spec_base`` a node forwarded at
        ``step`` sees (the committed prefix, or a pre-drafted tree's prefix and path). A host
        array: a search lays out every request's at once (`step_batch`), no operator each."""
        cols = np.zeros(width, dtype=bool)
        cols[: st.spec_base if st.prefix_len is None else st.prefix_len] = True
        if st.visible:
            cols[list(st.visible)] = True
        return cols

    def seen_columns(self, step: int, width: int) -> torch.Tensor | None:
        """``[width]`` bool: the speculative columns a node forwarded at ``step`` may see of its
        ancestors (None: all of them)."""
        return None

    def step_item(
        self, step: int, rid: str, st: RootState, tokens: torch.Tensor, seen: torch.Tensor
    ) -> BatchItem:
        """One request's ``topk`` frontier nodes at draft step ``step`` as a ragged item: KV token
        indices ``spec_base + (step - 1) * topk + i``, each seeing the prefix and, of the
        speculative region, ``seen [topk, S]`` (its forwarded ancestors and itself)."""
        k = self.spec.topk
        start = st.spec_base + (step - 1) * k
        mask = torch.from_numpy(np.tile(self.prefix_columns(step, st, start + k), (k, 1)))
        mask[:, st.spec_base :] = seen[:, : step * k]
        position = torch.full((k,), st.last_pos + self.position_offset(step))
        return BatchItem(rid, tokens, start, position, mask)

    # -- propose -------------------------------------------------------------------------------
    def propose(
        self, rids: list[str], roots: list[int], grammar: BatchGrammar | None = None
    ) -> list[DraftTree]:
        return self.search(rids, [self.roots[r] for r in rids], roots, grammar=grammar)[0]

    @torch.inference_mode()
    def search(
        self,
        rids: list[str],
        states: list[RootState],
        roots: list[int],
        *,
        record: bool = False,
        eager: bool = False,
        num_steps: int | None = None,
        grammar: BatchGrammar | None = None,
    ) -> tuple[list[DraftTree], list[Records] | None]:
        """One tree per state (``rids`` may repeat: several trees of one request, each in its own
        KV region). ``record``: also each tree's forwarded nodes (`NodeRecord`), for
        pre-drafting. ``eager``: no step graphs (pre-drafted batches are not the decode shapes
        they were captured for). ``num_steps``: a shallower search than the draft's own.
        ``grammar``: its constrained requests' nodes follow their grammars
        (`specmesh.draft_service.grammar`)."""
        steps = num_steps or self.spec.num_steps
        if steps > 1 and not eager:
            self.sizes.check_kv_entries(sum(s.spec_base for s in states), len(rids), steps - 1)
        whole = self.search_graphs
        if whole is not None and not (record or eager) and grammar is None:
            trees = whole.run(rids, states, roots) if steps == self.spec.num_steps else None
            if trees is not None:
                return trees, None
        logits = torch.stack([s.logits for s in states])  # [bs, draft_vocab]
        dev = logits.device  # the search runs where the draft's logits are; trees go to the host
        masks = None if grammar is None else grammar.frontier(
            self.to_target_ids(torch.arange(logits.shape[-1], device=dev)))  # fmt: skip
        (tokens, parents), records = self.grow(
            logits,
            torch.stack([s.hidden for s in states]),
            torch.tensor(roots, dtype=torch.int64, device=dev),
            steps,
            lambda hidden: self.stepper(rids, states, steps, eager, hidden),
            masks,
            states if record else None,
        )
        trees = host_trees(tokens, parents)
        return (trees if grammar is None else grammar.on_grammar(trees)), records

    def grow(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        roots: torch.Tensor,
        steps: int,
        stepper: Callable[[torch.Tensor], StepForward],
        masks: FrontierGrammar | None = None,
        recorded: list[RootState] | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[Records] | None]:
        """The search on the device: root ``logits [bs, draft_vocab]``, ``hidden [bs, H]`` and
        tokens ``roots [bs]`` -> the trees' (tokens, parents), each ``[bs, N]``. ``stepper``
        gives the step forward for the first frontier's input hidden; ``recorded``: the states
        whose nodes are recorded (pre-drafting). Nothing reads the host unless recording, so a
        search graph (`specmesh.draft_service.search_graph`) captures it whole."""
        k, bs, dev = self.spec.topk, logits.shape[0], logits.device
        logp = _log_probs(logits, masks)
        cand_logp, cand_ids = logp.topk(min(k + EXTRA_CANDIDATES, logp.shape[-1]), dim=-1)
        top_logp, tokens = cand_logp[:, :k], self.to_target_ids(cand_ids[:, :k])  # [bs, k]
        records = None if recorded is None else [
            root_record(s, self.to_target_ids(c), lp)
            for s, c, lp in zip(recorded, cand_ids, cand_logp, strict=True)]  # fmt: skip
        pool_tokens, pool_scores = [tokens], [top_logp]
        pool_parents = [torch.full((bs, k), -1, dtype=torch.int64, device=dev)]
        width = k * (steps - 1)
        frontier = _Frontier(
            tokens,
            top_logp,
            torch.arange(k, device=dev).expand(bs, k).clone(),
            hidden[:, None].expand(bs, k, -1).clone(),
            torch.zeros(bs, k, width, dtype=torch.bool, device=dev),
            [[(t,) for t in row] for row in tokens.tolist()] if records is not None else [],
            None if masks is None else masks.descend(torch.zeros_like(tokens), tokens, top_logp),
        )
        forward = stepper(frontier.hidden.flatten(0, 1))
        own = torch.eye(width, dtype=torch.bool, device=dev).view(steps - 1, k, width)
        for step in range(1, steps):
            frontier = self._expand(
                step, recorded, frontier, own[step - 1], (pool_tokens, pool_scores, pool_parents),
                records, forward,
            )  # fmt: skip
        tree = select_tree(
            roots,
            torch.cat(pool_scores, 1),
            torch.cat(pool_tokens, 1),
            torch.cat(pool_parents, 1),
            self.spec.num_draft_tokens,
        )
        return tree, records

    def stepper(
        self,
        rids: list[str],
        states: list[RootState],
        steps: int,
        eager: bool,
        hidden: torch.Tensor,
    ) -> StepForward:
        """How this search forwards a step: through the static-shape runners when they take the
        batch (`StepBatch`), else eagerly as ragged items."""
        graphs = None if eager else self.step_graphs
        if graphs is not None and steps > 1:
            batch = graphs.batch(self, rids, states, steps, hidden)
            if batch is not None:
                return batch.forward

        def ragged(step: int, tokens: torch.Tensor, hidden_in: torch.Tensor, seen: torch.Tensor):
            seen_cpu = seen.cpu()
            items = [self.step_item(step, r, st, tokens[b], seen_cpu[b])
                     for b, (r, st) in enumerate(zip(rids, states, strict=True))]  # fmt: skip
            return self.step_forward(step, items, hidden_in)

        return ragged

    def _expand(self, step, states, fr, own, pool, records, forward):
        k = self.spec.topk
        bs = fr.tokens.shape[0]
        pool_tokens, pool_scores, pool_parents = pool
        seen = fr.seen | own  # each frontier node's forwarded ancestors and itself
        cols = self.seen_columns(step, seen.shape[-1])
        visible = seen if cols is None else seen & cols
        hidden_out, logits = forward(step, fr.tokens, fr.hidden.flatten(0, 1), visible)
        logp = _log_probs(logits, fr.grammar)
        cand_logp, cand_ids = logp.topk(min(k + EXTRA_CANDIDATES, logp.shape[-1]), dim=-1)
        child_logp, child_ids = cand_logp[:, :k], cand_ids[:, :k]  # [bs * k, k]
        cum = (fr.scores.reshape(bs * k, 1) + child_logp).reshape(bs, k * k)
        child_tokens = self.to_target_ids(child_ids).reshape(bs, k * k)
        base = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(child_tokens)
        pool_scores.append(cum)
        pool_parents.append(fr.pool_idx[..., None].expand(bs, k, k).reshape(bs, k * k))
        best_scores, best = cum.topk(k, dim=-1)  # next frontier: [bs, k] indices into k * k
        parent = best // k
        hidden = hidden_out.view(bs, k, -1)
        paths = fr.paths  # kept only for records (pre-drafting), off the plain propose path
        if records is not None:
            cands = (self.to_target_ids(cand_ids).view(bs, k, -1).tolist(),
                     cand_logp.view(bs, k, -1).tolist())  # fmt: skip
            record_frontier(records, step, self.spec.topk, states, fr, hidden, cands)
            child_list = child_tokens.tolist()
            paths = [
                [fr.paths[b][i // k] + (child_list[b][i],) for i in row]
                for b, row in enumerate(best.tolist())
            ]
        next_tokens = child_tokens.gather(1, best)
        return _Frontier(
            next_tokens,
            best_scores,
            base + best,
            hidden.gather(1, parent[..., None].expand(-1, -1, hidden.shape[-1])),
            seen.gather(1, parent[..., None].expand(-1, -1, seen.shape[-1])),
            paths,
            fr.grammar and fr.grammar.descend(parent, next_tokens, best_scores),
        )


def host_trees(tokens: torch.Tensor, parents: torch.Tensor) -> list[DraftTree]:
    """The trees' (tokens, parents) ``[bs, N]`` on the host: one copy of the two for the batch
    (the target derives depths, masks and links itself)."""
    both = torch.stack((tokens, parents)).tolist()
    return [DraftTree(tuple(t), tuple(p)) for t, p in zip(*both, strict=True)]


def _log_probs(logits: torch.Tensor, masks: FrontierGrammar | None) -> torch.Tensor:
    """``[rows, draft_vocab]`` log-probabilities of a search's nodes (within their grammars)."""
    return torch.log_softmax(logits.float(), -1) if masks is None else masks.log_probs(logits)


@dataclass
class _Frontier:
    tokens: torch.Tensor  # [bs, k] target ids
    scores: torch.Tensor  # [bs, k] cumulative log-probabilities
    pool_idx: torch.Tensor  # [bs, k] index in the candidate pool
    hidden: torch.Tensor  # [bs, k, hidden] input hidden for each node's forward
    seen: torch.Tensor  # [bs, k, S] bool: each node's forwarded ancestors (speculative columns)
    paths: list[list[tuple[int, ...]]]  # each node's tokens below the root (recording only)
    grammar: FrontierGrammar | None = None  # each node's grammar state (constrained requests)


def forward_draft(
    model: torch.nn.Module,
    cache: KVCache,
    backend: AttentionBackend,
    items: list[BatchItem],
    pools: list[KVPair],
    hidden_in: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a draft network (``model(positions=..., kv_pools=..., backend=..., input_ids=...,
    input_embeds=..., hidden_in=...)`` returning (hidden_out, logits)) over a ragged batch."""
    return run_batch(_BoundHidden(model, hidden_in), cache, backend, items, kv_pools=pools)


class _BoundHidden:
    """Adapts a draft network to `run_batch`'s model interface by binding the hidden input."""

    def __init__(self, model: torch.nn.Module, hidden_in: torch.Tensor) -> None:
        self.model, self.hidden_in = model, hidden_in

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def __call__(self, **kwargs: object):
        return self.model(hidden_in=self.hidden_in, **kwargs)
