"""Fused elementwise kernels of a decoder layer on CUDA: what the unfused layer spends as a dozen
small launches per layer, done in one pass each.

- `add_rms_norm`: ``s = x + residual`` and ``rms_norm(s) * weight`` (RMSNorm alone without a
  residual), one program per row.
- `rope_store`: rotate q and k (rotate-half layout, ``x * cos + roll(x, D/2) * signed_sin``) and
  write the rotated k and v into their KV slots.
- `silu_mul`: ``silu(g) * u`` of a merged ``[g | u]`` gate-up product.

Each rounds where the torch ops it replaces round (every intermediate the torch path stores in
the model's dtype is rounded to it here too), so in fp32 the results equal the reference up to
the order of one reduction, and in bf16 they agree but for rare last-bit ties. The torch
references are the model's own unfused code (`runtime.models.layers`); the tests hold the two
together under the interpreter and on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, sum_ptr, out_ptr, w_ptr, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=live, other=0.0)
    if HAS_RES:  # the residual sum is rounded to the model's dtype before it is normed
        r = tl.load(res_ptr + row * n_cols + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=live)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)  # cast back before the weight (HF order)
    w = tl.load(w_ptr + cols, mask=live, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed * w.to(tl.float32)).to(x.dtype), mask=live)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s) * weight)`` with ``s = x + residual`` (``s = x`` without one); rows of
    ``[num_tokens, hidden]``, contiguous, weight of the same dtype."""
    x = x.contiguous()
    n, h = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    if n:
        res = x if residual is None else residual.contiguous()
        _add_rms_norm_kernel[(n,)](
            x, res, total, out, weight, h, eps,
            HAS_RES=residual is not None, BLOCK=next_pow2(h), num_warps=8 if h >= 2048 else 4,
        )  # fmt: skip
    return total, out


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out, k_out, cos_ptr, sin_ptr, k_pool, v_pool, slots_ptr,
    q_row, k_row, v_row, pool_row, n_q_heads, n_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    live = d < HEAD_DIM
    partner = tl.where(d < HALF, d + HALF, d - HALF)  # roll(x, D/2)[d] = x[(d + D/2) mod D]
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if head < n_q_heads + n_kv_heads:  # rotate a q head, or a k head (then store it)
        is_q = head < n_q_heads
        h = tl.where(is_q, head, head - n_q_heads)
        src = tl.where(is_q, q_ptr + tok * q_row, k_ptr + tok * k_row) + h * HEAD_DIM
        x = tl.load(src + d, mask=live, other=0.0)
        xr = tl.load(src + partner, mask=live, other=0.0)
        c = tl.load(cos_ptr + tok * HEAD_DIM + d, mask=live, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * HEAD_DIM + d, mask=live, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        b = (xr.to(tl.float32) * s).to(x.dtype).to(tl.float32)
        y = (a + b).to(x.dtype)
        if is_q:
            tl.store(q_out + tok * n_q_heads * HEAD_DIM + h * HEAD_DIM + d, y, mask=live)
        else:
            tl.store(k_out + tok * n_kv_heads * HEAD_DIM + h * HEAD_DIM + d, y, mask=live)
            dst = k_pool + slot * pool_row + h * HEAD_DIM + d
            tl.store(dst, y.to(k_pool.dtype.element_ty), mask=live)
    else:  # a v head: stored as it is
        h = head - n_q_heads - n_kv_heads
        v = tl.load(v_ptr + tok * v_row + h * HEAD_DIM + d, mask=live, other=0.0)
        dst = v_pool + slot * pool_row + h * HEAD_DIM + d
        tl.store(dst, v.to(v_pool.dtype.element_ty), mask=live)


def rope_store(
    q: torch.Tensor,  # [num_tokens, q_heads, head_dim], rows may be strided (a qkv slice)
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim], the model's dtype
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    k_pool: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_pool: torch.Tensor,
    slots: torch.Tensor,  # [num_tokens] int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated ``(q, k)`` (new contiguous tensors); the rotated k and v are written to
    ``slots`` of the pools, as `store_kv` writes them."""
    n, hq, dim = q.shape
    hkv = k.shape[1]
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError("rope_store needs each token's heads packed (stride(1) == head_dim)")
    if cos.shape[-1] != dim:
        raise ValueError(f"rope_store rotates whole heads: cos has {cos.shape[-1]} of {dim} dims")
    if k_pool.stride(1) != dim or k_pool.stride(2) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError("rope_store needs contiguous [slots, heads, head_dim] pools")
    q_out, k_out = torch.empty(n, hq, dim, dtype=q.dtype, device=q.device), torch.empty_like(k)
    if n:
        cos, signed_sin = cos.reshape(n, dim).contiguous(), signed_sin.reshape(n, dim).contiguous()
        _rope_store_kernel[(n, hq + 2 * hkv)](
            q, k, v, q_out, k_out, cos, signed_sin, k_pool, v_pool, slots,
            q.stride(0), k.stride(0), v.stride(0), k_pool.stride(0), hq, hkv,
            HEAD_DIM=dim, HALF=dim // 2, BLOCK=next_pow2(dim),
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=live, other=0.0)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=live, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # silu, rounded as F.silu
    tl.store(out_ptr + row * n_cols + cols, (act * u.to(tl.float32)).to(g.dtype), mask=live)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` of ``[num_tokens, 2 * inter]``."""
    gate_up = gate_up.contiguous()
    n, two = gate_up.shape
    inter = two // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
