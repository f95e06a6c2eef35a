"""Multi-head latent attention (DeepSeek-V2/V3) in the absorbed form, over a paged latent cache.

Per token and layer the cache holds ONE vector, not one per head (`KVCache(latent_dim=...)`):

    K pool [slots, 1, r + d_rope] = [ c_kv (r = kv_lora_rank, normalized) | k_pe (rope'd) ]
    V pool [slots, 1, r]          = a view of K's first r columns: c_kv again, stored once

so a token costs ``(kv_lora_rank + qk_rope_head_dim) * layers`` values (576 * 61 for
DeepSeek-V3) instead of ``2 * heads * head_dim * layers``.

transformers expands the latent into per-head keys and values, ``[k_nope | v] = W_UKV c_kv``.
Folding ``W_UK`` into the query and ``W_UV`` after the attention gives the same numbers up to
rounding and never materializes per-head K/V:

    q_nope · (W_UK^h c_j) = (W_UK^h^T q_nope) · c_j          q' = [W_UK^h^T q_nope | q_pe]
    sum_j p_j (W_UV^h c_j) = W_UV^h (sum_j p_j c_j)          out^h = W_UV^h (attention over c)

i.e. multi-query attention with one KV head whose K is ``[c_kv | k_pe]`` and V is ``c_kv``,
every head's query width ``r + d_rope``, the softmax scale of the original
``qk_nope + qk_rope`` width (`yarn.mla_softmax_scale`). Extend, decode and tree verify all run
this one path: the backend's masks (causal with offset, or the tree's) are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import MLAConfig, ModelConfig
from specmesh.runtime.models.layers import KVPair, RMSNorm, Rotary
from specmesh.runtime.models.yarn import mla_softmax_scale
from specmesh.runtime.parallel import SINGLE, TensorParallel

LORA_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): checkpoints with ``rope_interleave``
    rotate pairs of neighbours; in this order the rotate-half `Rotary` computes the same
    products and sums (transformers' ``apply_rotary_pos_emb_interleave`` returns this order)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """MLA over this rank's query heads (all of them at world size 1; `runtime.parallel`: the
    latent is computed and cached whole on every rank). Parameter names follow the
    checkpoints."""

    num_kv_heads = 1  # the latent cache has one "head"

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        m: MLAConfig = cfg.mla  # type: ignore[assignment]
        h, self.num_heads, self.m = cfg.hidden_size, cfg.num_heads // tp.world_size, m
        self.tp = tp
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=m.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.num_heads * qk_dim, bias=False)
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(h, latent, bias=m.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        kv_b_rows = self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, kv_b_rows, bias=False)
        self.o_proj = nn.Linear(self.num_heads * m.v_head_dim, h, bias=m.attention_bias)
        self.scale = mla_softmax_scale(cfg.rope, qk_dim)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.m.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[heads, qk_nope, r]`` and ``W_UV`` ``[heads, v_head_dim, r]``: views of
        ``kv_b_proj``'s weight, whose rows are ``[k_nope | v]`` per head."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: Rotary,
        kv: KVPair,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        m, n, heads = self.m, x.shape[0], self.num_heads
        q = self._query(x).view(n, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)[:, None]  # [num_tokens, 1, r]
        k_pe = k_pe[:, None]  # [num_tokens, 1, d_rope]
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rotary(q_pe, k_pe, positions)
        latent = torch.cat([c_kv, k_pe], -1)  # [num_tokens, 1, r + d_rope]
        # One write: V is a view of K's latent columns (`KVCache`), it fills itself.
        kv.k.index_copy_(0, backend.meta.out_slots, latent.to(kv.k.dtype))
        w_uk, w_uv = self._absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [num_tokens, heads, r]
        query = torch.cat([q_latent, q_pe], -1)  # [num_tokens, heads, r + d_rope]
        out = backend.forward(query, latent, c_kv, kv.k, kv.v, self.scale)  # [.., heads, r]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, num_tokens, v]
        return self.tp.all_reduce(self.o_proj(out.transpose(0, 1).reshape(n, heads * m.v_head_dim)))
