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
from specmesh.runtime.models.yarn import rope_attention_factor, yarn_inv_freq
from specmesh.runtime.parallel import SINGLE, TensorParallel, kv_head_range, vocab_range


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * (x * rsqrt(mean(x^2) + eps)), normalized in fp32 and cast back before the
        # weight (the Hugging Face order). On CPU `F.rms_norm` runs that same sequence of ops in
        # one call; elsewhere the ops are spelled out, as a fused kernel may round differently.
        dtype = x.dtype
        if not x.is_cpu:
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    if rope.kind == "yarn":
        return yarn_inv_freq(rope, head_dim)
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
    """Rotary embedding in the rotate-half layout; the draft builds its own from its own config.

    cos / sin depend on the positions only, so they are computed once per forward: every layer
    of a forward passes the same ``positions`` tensor, and the first call keeps its cos / sin for
    the calls that follow with that very tensor (the cache holds the tensor, so its identity
    cannot be reused; positions are never written in place between the layers of a forward).
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)
        self.attention_factor = rope_attention_factor(rope)  # scales cos and sin (YaRN)
        self._cached: tuple[object, ...] = ()  # (positions, inv_freq, dtype, cos, signed_sin)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = self.cos_sin(positions, q.dtype)
        return _apply_rope(q, cos, signed_sin), _apply_rope(k, cos, signed_sin)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``signed_sin`` ``[num_tokens, 1, head_dim]`` for ``positions``: signed_sin
        is sin with its first half negated, so that rotate_half(x) * sin ==
        roll(x, head_dim / 2) * signed_sin exactly (a negation is exact)."""
        c = self._cached
        if c and c[0] is positions and c[1] is self.inv_freq and c[2] == dtype:
            return c[3], c[4]  # type: ignore[return-value]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self._cached = (positions, self.inv_freq, dtype, cos, signed_sin)
        return cos, signed_sin


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = cat(-x2, x1) spelled as
    roll(x) * signed_sin: the same products and sum, in one op fewer than three."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


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
    """Self-attention over this rank's heads (all of them at world size 1): column-parallel
    q/k/v, row-parallel ``o_proj`` and one all-reduce (`parallel` module docstring)."""

    def __init__(self, shape: AttentionShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        s = shape
        in_size = s.input_size or s.hidden_size
        self.tp, self.head_dim = tp, s.head_dim
        self.reduce = tp.all_reduce if tp.enabled else None  # absent at world size 1
        self.num_heads = s.num_heads // tp.world_size
        self.num_kv_heads = kv_head_range(s.num_kv_heads, tp)[1]
        self.q_proj = nn.Linear(in_size, self.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(in_size, self.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(in_size, self.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * s.head_dim, s.hidden_size, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.qk_norm = s.qk_norm
        self.scale = s.head_dim**-0.5
        self.qkv: torch.Tensor | None = None  # set by `fuse`: [q; k; v] weights, one matrix
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """One q/k/v product instead of three, and the fused RoPE + KV store (CUDA only). The
        three weights become views of the one matrix: the parameters stay as they were named."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv = _merge([p.weight for p in projections])
        if self.q_proj.bias is not None:
            self.qkv_bias = _merge([p.bias for p in projections])

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        positions: torch.Tensor,  # [num_tokens]
        rotary: Rotary,
        kv: KVPair,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.qkv is not None:
            return self._fused_forward(x, positions, rotary, kv, backend)
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        store_kv(k, v, kv.k, kv.v, backend.meta.out_slots)
        out = backend.forward(q, k, v, kv.k, kv.v, self.scale)  # [num_tokens, heads, head_dim]
        out = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return out if self.reduce is None else self.reduce(out)

    def _fused_forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv: KVPair,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # fmt: skip
        from specmesh.kernels.fused import rope_store

        n, d = x.shape[0], self.head_dim
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1
        )
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, signed_sin = rotary.cos_sin(positions, q.dtype)
        q, k = rope_store(q, k, v, cos, signed_sin, kv.k, kv.v, backend.meta.out_slots)
        out = backend.forward(q, k, v, kv.k, kv.v, self.scale)
        out = self.o_proj(out.reshape(n, self.num_heads * d))
        return out if self.reduce is None else self.reduce(out)


def _merge(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 and make each input's data a view of its rows of the result."""
    merged = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        t.data = merged[start : start + t.shape[0]]
        start += t.shape[0]
    return merged


class MLP(nn.Module):
    """SwiGLU; column-parallel gate/up, row-parallel down and one all-reduce."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = tp.all_reduce if tp.enabled else None  # absent at world size 1
        local = intermediate_size // tp.world_size
        self.gate_proj = nn.Linear(hidden_size, local, bias=False)
        self.up_proj = nn.Linear(hidden_size, local, bias=False)
        self.down_proj = nn.Linear(local, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by `fuse`: [gate; up], one matrix

    def fuse(self) -> None:
        """One gate/up product and the fused SiLU * up (CUDA only); weights become views."""
        self.gate_up = _merge([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            from specmesh.kernels.fused import silu_mul

            out = self.down_proj(silu_mul(F.linear(x, self.gate_up)))
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.reduce is None else self.reduce(out)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the token embedding (`vocab_range`); ids
    outside them embed to zero here and the all-reduce adds the owning rank's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class PreNormBlock(nn.Module):
    """A residual pre-norm block: attention, then the MLP, each on its normed input. Subclasses
    build ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and ``mlp``."""

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

    def forward_fused(
        self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
        kv: KVPair, backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The block on its input ``h`` and ``x = input_layernorm(h)`` (computed by the caller,
        fused with the previous block's residual add): returns ``(h', m)`` whose sum is the
        block's output, left unadded so the next norm adds it in the same pass."""
        from specmesh.kernels.fused import add_rms_norm

        norm = self.post_attention_layernorm
        a = self.self_attn(x, positions, rotary, kv, backend)
        h, x = add_rms_norm(a, norm.weight, norm.eps, h)
        return h, self.mlp(x)


class DecoderLayer(PreNormBlock):
    """Pre-norm Llama block. ``input_layernorm`` is optional (EAGLE-1 layer 0 has none)."""

    def __init__(
        self,
        shape: AttentionShape,
        intermediate_size: int,
        *,
        input_norm: bool = True,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps) if input_norm else nn.Identity()
        self.self_attn = Attention(shape, tp)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps)
        self.mlp = MLP(shape.hidden_size, intermediate_size, tp)
