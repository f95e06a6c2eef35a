"""Building blocks shared by the target models and the draft models.

Parameter names follow the Hugging Face checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``, …) so a
checkpoint loads by name. Attention never touches the KV layout itself: it writes the new K/V into
the pool it is handed and asks the backend for the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.runtime.attention.base import AttentionBackend, store_kv
from specmesh.runtime.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Rotary(nn.Module):
    """Rotary embedding in the rotate-half layout; the draft builds its own from its own config."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    input_size: int | None = None  # 2H for the EAGLE-3 midlayer, else hidden_size


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    """The attention dimensions of a decoder layer of ``cfg`` (input width = hidden size)."""
    return AttentionShape(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        cfg.qkv_bias, cfg.qk_norm, cfg.rms_norm_eps,
    )  # fmt: skip


@dataclass
class KVPair:
    """The K and V slot pools of one attention layer: ``[num_slots, num_kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor


class Attention(nn.Module):
    def __init__(self, shape: AttentionShape) -> None:
        super().__init__()
        s = shape
        in_size = s.input_size or s.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(in_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(in_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(in_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.qk_norm = s.qk_norm
        self.scale = s.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        positions: torch.Tensor,  # [num_tokens]
        rotary: Rotary,
        kv: KVPair,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        store_kv(k, v, kv.k, kv.v, backend.meta.out_slots)
        out = backend.forward(q, k, v, kv.k, kv.v, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. ``input_layernorm`` is optional (EAGLE-1 layer 0 has none)."""

    def __init__(
        self, shape: AttentionShape, intermediate_size: int, *, input_norm: bool = True
    ) -> None:
        super().__init__()
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps) if input_norm else nn.Identity()
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps)
        self.mlp = MLP(shape.hidden_size, intermediate_size)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        rotary: Rotary,
        kv: KVPair,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, kv, backend)
        return h + self.mlp(self.post_attention_layernorm(h))
