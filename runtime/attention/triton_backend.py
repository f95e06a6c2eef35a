"""Attention backend on the Triton paged-attention kernel (``specmesh.kernels.attention``).

Sync-free: the kernel's grid comes from tensor shapes, so the backend reads no ``*_cpu`` /
``max_*`` metadata. Like every backend it expects the caller to have written the new tokens'
K/V into the pools (``store_kv``) before ``forward``.
"""

from __future__ import annotations

import torch

from specmesh.kernels.attention import paged_attention
from specmesh.runtime.attention.base import AttentionBackend


class TritonBackend(AttentionBackend):
    name = "triton"
    needs_cpu_metadata = False

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return paged_attention(q, k_pool, v_pool, self.meta, scale, impl="triton")
