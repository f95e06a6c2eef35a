"""A feature draft's extend after a verify through one static-shape runner (a CUDA graph per
batch size on a GPU; the same buffers run eagerly on CPU).

After every verify the draft extends each request over the 1 .. ``num_steps + 1`` tokens the
target just committed. The runner forwards exactly ``width = num_steps + 1`` rows per request:

    request b rows:  [ accepted rows (q_b) | filler rows (width - q_b): token 0, zero features ]
    KV written:      committed area          the request's own slots past its committed length

Filler rows sit after the real ones, so causal attention keeps every real row from seeing them,
and they write only slots of the speculative area that the next decode step overwrites (nothing
is committed there). The drafter commits the real rows and keeps each request's last real row.

Prefill extends (new requests, multimodal embeddings), requests within ``width`` tokens of their
context limit, and batches whose padded rows the KV cache cannot hold run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.model_runner import BatchItem
from specmesh.runtime.static_shapes import draft_extend_sizes

if TYPE_CHECKING:
    from specmesh.draft_service.feature_drafter import FeatureDrafter


class DraftExtendGraph:
    def __init__(self, drafter: FeatureDrafter, *, mode: str, max_bs: int) -> None:
        cache = drafter.cache
        self.cache, self.width = cache, drafter.spec.num_steps + 1
        max_bs = min(max_bs, drafter.sizes.max_bs)
        base = drafter.net.config.base
        self.runner = GraphRunner(
            drafter.net, cache, drafter.backend,
            draft_extend_sizes(max_bs, self.width, cache.max_context), mode=mode,
            kv_pools=drafter.pools_for_step(0), hidden_in=(drafter.net.feature_width, base.dtype),
        )  # fmt: skip
        self.runner.capture()

    def fits(self, items: list[BatchItem]) -> bool:
        w = self.width
        return (
            len(items) <= max(self.runner.batch_sizes)
            and all(it.input_embeds is None and it.q_len <= w for it in items)
            and all(it.start + w <= self.cache.max_context for it in items)
            and self.cache.can_allocate({it.rid: it.start + w for it in items})
        )

    def run(
        self, items: list[BatchItem], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, logits) of each request's last real row (``fits(items)`` must hold); copies,
        so they outlive the next replay."""
        w = self.width
        ids = np.zeros((len(items), w), dtype=np.int64)  # filler rows: token 0
        padded = []
        for row, it in zip(ids, items, strict=True):  # host ids (`rotated_rows`)
            row[: it.q_len] = it.input_ids.numpy()
            padded.append(BatchItem(it.rid, torch.from_numpy(row), it.start))
        feats = features.new_zeros(len(items) * w, features.shape[1])
        # The real rows of the padded batch, and each request's last: one copy to the device.
        starts = np.arange(len(items)) * w
        q_lens = np.array([it.q_len for it in items])
        real = (
            np.repeat(starts, q_lens)
            + np.arange(q_lens.sum())
            - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        )
        rows = torch.from_numpy(np.concatenate([real, starts + q_lens - 1])).to(features.device)
        real_rows, last = rows.split([len(real), len(items)])
        feats.index_copy_(0, real_rows, features)
        hidden, logits = self.runner.run(padded, feats)
        return hidden[last], logits[last]
