"""The attention-backend interface and the metadata every backend reads.

Layout of one batch (ragged, FlashInfer-style; request b owns rows
``qo_indptr[b]:qo_indptr[b+1]`` of the flat query tensor and slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of the KV pool, the new tokens last; every indptr
starts at 0 and its segments follow each other, so equal-length requests form a grid):

    request b:  kv = [ prefix (already cached) ............ | new tokens (q rows) ]
                      kv_len_b - q_len_b                      q_len_b

Masks. With ``custom_mask is None`` query row i of request b sees kv columns
``j <= kv_len_b - q_len_b + i`` (causal with an offset: extend, chunked extend and decode are all
this case). Otherwise ``custom_mask[mask_indptr[b]:mask_indptr[b+1]]`` is request b's row-major
``[q_len_b, kv_len_b]`` boolean mask (tree verify and tree draft decode: prefix + ancestors + self).

The CPU-side fields (``*_cpu``, ``max_*``) may be ``None`` on the sync-free GPU path (DESIGN.md
§4 invariant 3); a backend says what it needs through ``Backend.needs_cpu_metadata`` and
allocates upper bounds when it does not get them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [bs + 1] int64, query rows per request
    kv_indptr: torch.Tensor  # [bs + 1] int64, kv slots per request
    kv_indices: torch.Tensor  # [sum kv_len] int64, slot ids into the KV pool
    out_slots: torch.Tensor  # [num_tokens] int64, where the new tokens' K/V are written
    custom_mask: torch.Tensor | None = None  # [sum q_len * kv_len] bool, or None = causal
    mask_indptr: torch.Tensor | None = None  # [bs + 1] int64, set with custom_mask
    # CPU copies; may be None on the sync-free path.
    q_lens_cpu: list[int] | None = None
    kv_lens_cpu: list[int] | None = None
    max_q_len: int | None = None
    max_kv_len: int | None = None

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


class AttentionBackend:
    """One object per model runner; ``forward`` is called once per layer.

    ``prepare`` runs once per batch before the layers; the graph hooks let a CUDA-graph runner
    keep the metadata in static buffers (``init_capture`` allocates them for ``max_bs``,
    ``prepare_for_capture`` / ``prepare_for_replay`` fill them for one bucket).
    """

    name: str = "base"
    needs_cpu_metadata: bool = True

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_pool: torch.Tensor,  # [num_slots, num_kv_heads, v_head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]; v_head_dim = head_dim but in MLA
        raise NotImplementedError

    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def prepare_for_capture(self, bs: int, num_tokens: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def prepare_for_replay(self, meta: AttentionMetadata, bs: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write the new tokens' K/V into their slots (every backend does this the same way): one
    ``index_copy_`` per pool. Slots are distinct except the graph runner's padding slot, which
    only padding rows write and read."""
    k_pool.index_copy_(0, slots, k if k.dtype == k_pool.dtype else k.to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v if v.dtype == v_pool.dtype else v.to(v_pool.dtype))
