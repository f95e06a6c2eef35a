"""The static buffers a graph runner fills and a captured forward reads (layout: the module
docstring of `specmesh.runtime.graph_runner`), allocated once at `GraphSizes`' upper bounds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.graph_sizes import GraphSizes


@dataclass
class GraphBuffers:
    """Everything a captured forward reads, allocated once at the sizes' upper bounds."""

    input_ids: torch.Tensor  # [max_num_tokens] int64
    positions: torch.Tensor  # [max_num_tokens] int64
    out_slots: torch.Tensor  # [max_num_tokens] int64, where each row's K/V is written
    qo_indptr: torch.Tensor  # [max_bs + 1] int64, constant: q rows per request
    kv_indptr: torch.Tensor  # [max_bs + 1] int64
    kv_indices: torch.Tensor  # [kv_indices_capacity] int64
    custom_mask: torch.Tensor | None  # [mask_capacity] bool, tree modes only
    mask_indptr: torch.Tensor | None  # [max_bs + 1] int64, tree modes only
    hidden_in: torch.Tensor | None  # [max_num_tokens, hidden], draft networks only
    pad_rows: torch.Tensor  # [max_bs] int64: q * (1 .. max_bs), indptr steps of padding requests
    pad_mask: torch.Tensor | None  # [max_bs * q * q] bool: lower-triangular [q, q] per request

    @staticmethod
    def allocate(
        sizes: GraphSizes,
        device: torch.device,
        pad_slot: int,
        hidden_in: tuple[int, torch.dtype] | None = None,  # (hidden size, dtype)
    ) -> GraphBuffers:
        n, q, bs = sizes.max_num_tokens, sizes.tokens_per_req, sizes.max_bs
        ints = dict(dtype=torch.int64, device=device)
        tril = torch.ones(q, q, dtype=torch.bool, device=device).tril().flatten()
        return GraphBuffers(
            input_ids=torch.zeros(n, **ints),
            positions=torch.zeros(n, **ints),
            out_slots=torch.full((n,), pad_slot, **ints),
            qo_indptr=torch.arange(0, (bs + 1) * q, q, **ints),
            kv_indptr=torch.zeros(bs + 1, **ints),
            kv_indices=torch.full((sizes.kv_indices_capacity,), pad_slot, **ints),
            custom_mask=torch.zeros(sizes.mask_capacity, dtype=torch.bool, device=device)
            if sizes.has_mask
            else None,
            mask_indptr=torch.zeros(bs + 1, **ints) if sizes.has_mask else None,
            hidden_in=None
            if hidden_in is None
            else torch.zeros(n, hidden_in[0], dtype=hidden_in[1], device=device),
            pad_rows=torch.arange(1, bs + 1, **ints) * q,
            pad_mask=tril.repeat(bs) if sizes.has_mask else None,
        )

    def metadata(self, bs: int, q: int, kv_lens_cpu: list[int] | None) -> AttentionMetadata:
        """The bucket's metadata: fixed-shape views of the buffers (the same tensors every call,
        so a captured graph reads whatever was last filled in). CPU fields only when given."""
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            out_slots=self.out_slots[: bs * q],
            custom_mask=self.custom_mask,
            mask_indptr=None if self.mask_indptr is None else self.mask_indptr[: bs + 1],
            q_lens_cpu=None if kv_lens_cpu is None else [q] * bs,
            kv_lens_cpu=kv_lens_cpu,
            max_q_len=None if kv_lens_cpu is None else q,
            max_kv_len=None if kv_lens_cpu is None else max(kv_lens_cpu),
        )
