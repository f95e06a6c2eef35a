"""Attention backend on the Triton paged-attention kernels: ``specmesh.kernels.attention``, and
``specmesh.kernels.mla_attention`` when V is narrower than K (multi-head latent attention, V a
view of K's latent columns).

Sync-free: the kernel's grid comes from tensor shapes, so the backend reads no ``*_cpu`` /
``max_*`` metadata. Like every backend it expects the caller to have written the new tokens'
K/V into the pools (``store_kv``) before ``forward``.
"""

from __future__ import annotations

import torch

from specmesh.kernels.attention import paged_attention
from specmesh.kernels.mla_attention import mla_attention
from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    name = "triton"
    needs_cpu_metadata = False

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_pool: torch.Tensor,  # [num_slots, num_kv_heads, v_head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]; v_head_dim = head_dim but in MLA
        if v_pool.shape[-1] != k_pool.shape[-1]:  # MLA: one kv head, V = K's latent columns
            return mla_attention(q, k_pool, v_pool, self.meta, scale, impl="triton")
        return paged_attention(q, k_pool, v_pool, self.meta, scale, impl="triton")

    # -- CUDA-graph hooks ------------------------------------------------------------------------
    # The kernel takes its grid from tensor shapes and reads only device tensors, so a graph
    # runner's static metadata (fixed-shape views of its buffers, `runtime/graph_runner.py`) can
    # be read in place: the hooks bind those views and check their shapes; nothing is copied and
    # no CPU field is read (invariant 3).
    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        self.max_graph_bs, self.max_graph_tokens = max_bs, max_num_tokens

    def prepare_for_capture(self, bs: int, num_tokens: int) -> None:
        if bs > self.max_graph_bs or num_tokens > self.max_graph_tokens:
            raise ValueError(
                f"triton graph bucket bs={bs}, num_tokens={num_tokens} exceeds init_capture's "
                f"max_bs={self.max_graph_bs}, max_num_tokens={self.max_graph_tokens}"
            )

    def prepare_for_replay(self, meta: AttentionMetadata, bs: int) -> None:
        if meta.batch_size != bs:
            raise ValueError(f"triton graph replay for bs={bs} got metadata of {meta.batch_size}")
        self.meta = meta
