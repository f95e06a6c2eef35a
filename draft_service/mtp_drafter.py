"""Multi-layer EAGLE / MTP drafting: draft step j runs MTP layer ``j % L`` in that layer's own KV pool.

Each layer owns one pool of the drafter's `KVCache` (all pools share the request-to-slot table, so
token index p is the same slot in every pool). `pools_for_step` hands a step its layer's pool and
`_pool` checks it is exactly that one: two layers can never write into one pool (DESIGN.md §4,
invariant 4, SGLang PR #22954).

Extend over a request's new rows p = start .. end-1 (T = end; the pending token x_T is known):

    layer 0:  (target pre-norm hidden p, token p+1)              -> h0[p], greedy g0[p]
    layer i:  (h_{i-1}[p],               token p+1+i)            -> h_i[p], greedy g_i[p]

Layer i's token column is layer i-1's shifted left by one, with layer i-1's greedy prediction at
the last row appended (SGLang's multi-layer EAGLE chain). So its last i rows use guessed tokens
(x_{T+1} .. x_{T+i} are not known yet), and the guesses are the greedy chain g0[T-1], g1[T-1], ...
Those rows stay committed after the real tokens arrive: an approximation of the layers' context
that only costs acceptance, never correctness, since verification is lossless.

Propose. Step 0's children are the top-k of layer 0's last row. A node forwarded at step j >= 1
pairs its parent's output hidden with its own token, which is what layer l = j % L computes at
row ``last_pos`` while j < L (the row where the extend put its greedy guess), or, once the steps
wrap around the layers, at row ``last_pos + L * (j // L)``; that row is its RoPE position. Its KV
goes to the speculative indices of step j (``spec_base + (j-1)*topk + i``) in pool l, and it sees:

    - pool l's committed rows 0 .. T-1, except, for l >= 1, row ``last_pos``: that row is the
      extend's greedy guess of step l, which the node itself (j = l) or its own step-l ancestor
      (j > l) replaces;
    - those of its ancestors that were forwarded through the same pool (steps j - L, j - 2L, ...;
      none when L >= num_steps: the node sees the prefix and itself);
    - itself.

So with topk = 1 the tree is the extend's greedy chain g0, g1, ..., continued through the
layers again when num_steps > L (tested against transformers' decoder layer).
"""

from __future__ import annotations

import numpy as np
import torch

from specmesh.draft_service.drafter import RootState, TreeDrafter, forward_draft
from specmesh.draft_service.feature_drafter import check_features, rotated_rows
from specmesh.draft_service.models.mtp import MTPDraft
from specmesh.protocol.config import SpecParams
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem
from specmesh.runtime.models.layers import KVPair


class MTPDrafter(TreeDrafter):
    needs = FeatureSpec(Feature.HIDDEN_PRE_NORM)
    supports_predraft = False  # a step's layer is its depth: an outcome's subtree has none

    def __init__(
        self, net: MTPDraft, cache: KVCache, backend: AttentionBackend, spec: SpecParams
    ) -> None:
        super().__init__(cache, backend, spec)
        self.net = net
        self.num_layers = net.config.num_layers  # L
        if len(cache.pools) != self.num_active_layers(self.num_layers, spec):
            raise ValueError(
                f"MTP drafter needs one KV pool per used layer "
                f"({self.num_active_layers(self.num_layers, spec)}), the cache has {len(cache.pools)}"
            )
        if len({p.k.data_ptr() for p in cache.pools}) != len(cache.pools):
            raise ValueError("MTP layers must not share a KV pool")
        # Layer l's row t reads token t + l + 1; the last layers' last rows hold guesses, which
        # a block keyed this far ahead never covers (`prefix_rows`).
        self.prefix_lookahead = len(cache.pools)
        self._seen_columns: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def num_active_layers(num_layers: int, spec: SpecParams) -> int:
        """Layers a round runs: steps beyond L wrap around, layers beyond num_steps never run."""
        return min(num_layers, spec.num_steps)

    def layer_of(self, step: int) -> int:
        return step % self.num_layers

    # -- KV pools (invariant 4) ----------------------------------------------------------------
    def pools_for_step(self, step: int) -> list[KVPair]:
        return [self.cache.pools[self.layer_of(step)]]

    def _pool(self, step: int) -> list[KVPair]:
        """`pools_for_step`, checked: step ``step`` must get its own layer's pool and no other."""
        pools, layer = self.pools_for_step(step), self.layer_of(step)
        own = self.cache.pools[layer]
        if (
            len(pools) != 1
            or pools[0].k.data_ptr() != own.k.data_ptr()
            or pools[0].v.data_ptr() != own.v.data_ptr()
        ):
            raise RuntimeError(
                f"MTP draft step {step} (layer {layer}) was handed a KV pool that is not layer "
                f"{layer}'s own: each layer writes only its own pool (DESIGN.md §4 invariant 4)"
            )
        return pools

    # -- extend --------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, inputs: list[ExtendInput]) -> None:
        items, feats = [], []
        for inp in inputs:
            check_features(inp, self.needs.feature)
            ids, embeds = rotated_rows(inp, self.net.embed)  # validates before any state changes
            if inp.new:
                self.cache.add(inp.rid)
                if self.prefixes is not None:
                    self.prefixes.start(inp, [*inp.committed_ids, inp.next_token])
            start = self.cache.get(inp.rid).committed_len
            skip = start if inp.new else 0  # rows the prefix cache had, in every layer's pool
            embeds = None if embeds is None else embeds[skip:]
            items.append(BatchItem(inp.rid, ids[skip:], start, input_embeds=embeds))
            feats.append(inp.features[skip:])
        last = (torch.tensor([it.q_len for it in items]).cumsum(0) - 1).tolist()
        hidden, logits = self._forward_step(0, items, torch.cat(feats))  # target pre-norm in
        roots = [(hidden[row], logits[row]) for row in last]
        for layer in range(1, self.num_active_layers(self.num_layers, self.spec)):
            greedy = logits[last].argmax(-1).tolist()
            items = [self._shift(it, tok) for it, tok in zip(items, greedy, strict=True)]
            hidden, logits = self._forward_step(layer, items, hidden)
        for it, (h, lg), inp in zip(items, roots, inputs, strict=True):
            end = it.start + it.q_len
            self.cache.commit(it.rid, end)
            self.roots[it.rid] = RootState(end - 1, end, h, lg)
            if self.prefixes is not None and inp.new:  # `DraftPrefixes.keep`: starts only
                self.prefixes.keep(inp, [*inp.committed_ids, inp.next_token])

    def _forward_step(
        self, step: int, items: list[BatchItem], hidden_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``items`` through step ``step``'s layer in that layer's pool (extend runs
        layer i as step i)."""
        net = self.net.layer_net(self.layer_of(step))
        return forward_draft(net, self.cache, self.backend, items, self._pool(step), hidden_in)

    def _shift(self, it: BatchItem, token: int) -> BatchItem:
        """The next layer's rows: tokens one further ahead, the guess ``token`` appended."""
        ids = torch.cat([it.input_ids[1:], torch.tensor([token])])
        embeds = None
        if it.input_embeds is not None:
            new = self.net.embed(torch.tensor([token], device=it.input_embeds.device))
            embeds = torch.cat([it.input_embeds[1:], new.to(it.input_embeds.dtype)])
        return BatchItem(it.rid, ids, it.start, input_embeds=embeds)

    # -- propose -------------------------------------------------------------------------------
    def position_offset(self, step: int) -> int:
        return self.num_layers * (step // self.num_layers)

    def prefix_columns(self, step: int, st: RootState, width: int) -> np.ndarray:
        cols = np.zeros(width, dtype=bool)
        cols[: st.spec_base] = True
        if self.layer_of(step) > 0:
            cols[st.last_pos] = False  # the extend's greedy guess of this node's step-l row
        return cols

    def seen_columns(self, step: int, width: int) -> torch.Tensor:
        """Only ancestors forwarded through this step's layer (its pool); made once per layer."""
        key = (self.layer_of(step), width)
        if key not in self._seen_columns:
            k, dev = self.spec.topk, self.cache.req_to_slot.device
            same = [self.layer_of(c // k + 1) == key[0] for c in range(width)]
            self._seen_columns[key] = torch.tensor(same, device=dev)
        return self._seen_columns[key]

    def step_forward(
        self, step: int, items: list[BatchItem], hidden_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward_step(step, items, hidden_in)
