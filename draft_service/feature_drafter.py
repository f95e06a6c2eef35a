"""Drafters fed by target features (EAGLE-3 aux states, EAGLE-1 final hidden states).

Extend pairs target feature p with token p + 1: the committed ids are rotated left by one per
request and the request's pending token fills the last row (DESIGN.md §2). For a multimodal
request the embedding rows are the target's ``mm_input_embeds`` rotated the same way, and only the
pending token is embedded by the draft: placeholder ids are never looked up (invariant 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specmesh.draft_service.drafter import RootState, TreeDrafter, forward_draft
from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem

if TYPE_CHECKING:
    from specmesh.draft_service.extend_graph import DraftExtendGraph


def check_features(inp: ExtendInput, feature: Feature) -> None:
    """One feature row per committed token, or a precise error."""
    if inp.features is None or inp.features.shape[0] != len(inp.committed_ids):
        got = None if inp.features is None else inp.features.shape[0]
        raise InvalidRequestError(
            f"request {inp.rid!r}: extend needs {len(inp.committed_ids)} feature rows "
            f"({feature.value}), got {got}"
        )


def rotated_rows(
    inp: ExtendInput, embed: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids ``committed[1:] + [next]`` and, for multimodal input, embeddings
    ``mm_input_embeds[1:] ++ embed(next)``, for ONE request."""
    ids = torch.from_numpy(np.array([*inp.committed_ids[1:], inp.next_token], dtype=np.int64))
    if inp.mm_input_embeds is None:
        if inp.is_multimodal and inp.new:
            raise InvalidRequestError(
                f"request {inp.rid!r} has images but its extend carries no mm_input_embeds"
            )
        return ids, None
    if inp.mm_input_embeds.shape[0] != len(inp.committed_ids):
        raise InvalidRequestError(
            f"request {inp.rid!r}: mm_input_embeds has {inp.mm_input_embeds.shape[0]} rows for "
            f"{len(inp.committed_ids)} tokens"
        )
    mm = inp.mm_input_embeds
    nxt = embed(torch.tensor([inp.next_token], device=mm.device)).to(mm.dtype)
    return ids, torch.cat([mm[1:], nxt])


class FeatureDrafter(TreeDrafter):
    def __init__(
        self,
        net: torch.nn.Module,
        cache: KVCache,
        backend: AttentionBackend,
        spec: SpecParams,
        needs: FeatureSpec,
    ) -> None:
        super().__init__(cache, backend, spec)
        self.net, self.needs = net, needs
        self.extend_graph: DraftExtendGraph | None = None  # see enable_step_graphs

    def enable_step_graphs(self, mode: str, max_bs: int, *, extend: bool = True) -> None:
        """Decode steps and (``extend``) the extend after each verify through static-shape
        runners."""
        from specmesh.draft_service.extend_graph import DraftExtendGraph

        super().enable_step_graphs(mode, max_bs)
        if extend:
            self.extend_graph = DraftExtendGraph(self, mode=mode, max_bs=max_bs)

    @torch.inference_mode()
    def extend(self, inputs: list[ExtendInput]) -> None:
        items, feats = [], []
        for inp in inputs:
            check_features(inp, self.needs.feature)
            ids, embeds = rotated_rows(inp, self.net.embed)
            if inp.new:  # only after every check, so a rejected extend leaves no KV row behind
                self.cache.add(inp.rid)
                if self.prefixes is not None:
                    self.prefixes.start(inp, [*inp.committed_ids, inp.next_token])
            start = self.cache.get(inp.rid).committed_len
            rows = inp.features
            if skip := start if inp.new else 0:  # rows the prefix cache had
                ids, rows = ids[skip:], rows[skip:]
                embeds = None if embeds is None else embeds[skip:]
            items.append(BatchItem(inp.rid, ids, start, input_embeds=embeds))
            feats.append(rows)
        hidden, logits = self._forward_extend(items, torch.cat(feats))
        lasts = zip(items, inputs, hidden.unbind(), logits.unbind(), strict=True)
        for it, inp, h, lg in lasts:  # each request's own last row, as views
            end = it.start + it.q_len
            self.cache.commit(it.rid, end)
            self.roots[it.rid] = RootState(end - 1, end, h, lg)
            if self.prefixes is not None and inp.new:  # `DraftPrefixes.keep`: starts only
                self.prefixes.keep(inp, [*inp.committed_ids, inp.next_token])

    def _forward_extend(
        self, items: list[BatchItem], feats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, logits) of each request's last extend row."""
        graph = self.extend_graph
        if graph is not None and graph.fits(items):
            return graph.run(items, feats)
        hidden, logits = forward_draft(
            self.net, self.cache, self.backend, items, self.pools_for_step(0), feats
        )
        last = torch.tensor([it.q_len for it in items]).cumsum(0) - 1
        return hidden[last], logits[last]

    def step_forward(
        self, step: int, items: list[BatchItem], hidden_in: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward_draft(
            self.net, self.cache, self.backend, items, self.pools_for_step(step), hidden_in
        )

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.net.to_target_ids(draft_ids)
