"""Multi-head latent attention (DeepSeek-V3 MLA, absorbed form) over the paged layout.

The contract is `kernels.attention`'s (rows, kv slots, causal-with-offset or custom masks; torch
reference `paged_attention_ref`) with V narrower than K and one KV head (multi-query):

    K pool [slots, 1, Dk]: [ latent (Dv columns) | rope key (Dk - Dv columns) ]
    V pool [slots, 1, Dv]: in the model a strided view of K's first Dv columns (`KVCache`),
                           read in place through its strides; never copied

    query  [tokens, heads, Dk] = [ W_UK^T q_nope | q_pe ]  ->  out [tokens, heads, Dv]

Triton launch (sync-free, grid from shapes): one program per (query row, block of ``BLOCK_H``
heads, split); every head of the block reads the same kv tiles. The dot product q . k is split
into its latent part and its rope part, each padded to a power of two and masked (as SGLang's
grouped decode kernel and FlashMLA do): 512 + 64 for DeepSeek-V3 (Dk = 576 is no power of
two), 32 + 8 for the tiny test model -- one code path. When V is K's latent view (same storage,
same row stride, the model's case) the latent tile loaded for the scores is also the value tile:
one load per kv tile. Products are ``tl.dot`` with fp32 accumulation: fp32 models multiply in
IEEE fp32 (no TF32, so the kernel matches the reference at fp32 tolerances), fp16 / bf16 models
in their dtype (the probabilities rounded to it, as FlashAttention does; bf16 only on a GPU:
the interpreter's numpy has no bf16, so there it multiplies in fp32). ``tl.dot`` needs every
dimension >= 16 on a GPU, hence the floors on the pads and on ``BLOCK_H``. Splits of a row's kv
(flash-decoding) are merged by `kernels.attention`'s merge kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specmesh.kernels.attention import (
    default_num_splits,
    dot_types,
    merge_splits_kernel,
    paged_attention_ref,
    row_kv_span,
)
from specmesh.kernels.common import next_pow2, pick_impl

if TYPE_CHECKING:  # a type only: kernels do not import the runtime
    from specmesh.runtime.attention.base import AttentionMetadata

BLOCK_H = 16  # query heads per program (tl.dot's smallest M)
BLOCK_N = 32  # kv columns per tile


@triton.jit
def _mla_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qo_indptr, kv_indptr, kv_indices, mask_ptr, mask_indptr,
    batch_size, num_heads, scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kd, stride_vt, stride_vd,
    stride_ot, stride_oh,
    V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, LAT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_BS: tl.constexpr,
    HAS_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr, SHARED_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2).to(tl.int64)
    kv_start, lo, hi, mask_start = row_kv_span(
        qo_indptr, kv_indptr, mask_indptr, batch_size, row, split,
        HAS_MASK=HAS_MASK, NUM_SPLITS=NUM_SPLITS, BLOCK_N=BLOCK_N, BLOCK_BS=BLOCK_BS,
    )  # fmt: skip
    h_ok = heads < num_heads
    lat = tl.arange(0, LAT_PAD)
    rope = tl.arange(0, ROPE_PAD)
    lat_ok, rope_ok = lat < V_DIM, rope < ROPE_DIM
    q_row = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :] * stride_qd, mask=h_ok[:, None] & lat_ok[None, :],
                    other=0.0).to(DOT_DTYPE)  # [H, L]  # fmt: skip
    q_pe = tl.load(q_row + (V_DIM + rope[None, :]) * stride_qd,
                   mask=h_ok[:, None] & rope_ok[None, :], other=0.0).to(DOT_DTYPE)  # fmt: skip

    # A finite start keeps exp(m_old - m_new) defined when a whole tile is masked.
    m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, LAT_PAD), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0)
        k_row = k_ptr + slots[:, None] * stride_kt
        k_lat = tl.load(k_row + lat[None, :] * stride_kd, mask=col_ok[:, None] & lat_ok[None, :],
                        other=0.0).to(DOT_DTYPE)  # [N, L]  # fmt: skip
        k_pe = tl.load(k_row + (V_DIM + rope[None, :]) * stride_kd,
                       mask=col_ok[:, None] & rope_ok[None, :], other=0.0).to(DOT_DTYPE)  # fmt: skip
        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)  # [H, N]
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores *= scale
        visible = col_ok
        if HAS_MASK:
            visible = visible & (tl.load(mask_ptr + mask_start + cols, mask=col_ok, other=0) != 0)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [H, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SHARED_V:  # V is K's latent columns: the tile is already loaded
            values = k_lat
        else:
            values = tl.load(v_ptr + slots[:, None] * stride_vt + lat[None, :] * stride_vd,
                             mask=col_ok[:, None] & lat_ok[None, :], other=0.0)  # fmt: skip
            values = values.to(DOT_DTYPE)  # [N, L]
        pv = tl.dot(p.to(DOT_DTYPE), values, input_precision=DOT_PRECISION)  # [H, L]
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_mask = h_ok[:, None] & lat_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_offs = row * stride_ot + heads[:, None] * stride_oh + lat[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # unnormalised partials, combined by kernels.attention.merge_splits_kernel
        part = (row * num_heads + heads) * NUM_SPLITS + split  # [H]
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_acc_ptr + part[:, None] * LAT_PAD + lat[None, :], acc, mask=out_mask)


def v_is_k_latent(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether V is a view of K's first columns (then the kernel loads each tile once)."""
    return v_pool.data_ptr() == k_pool.data_ptr() and v_pool.stride() == k_pool.stride()


def mla_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, Dk]
    k_pool: torch.Tensor,  # [num_slots, 1, Dk]
    v_pool: torch.Tensor,  # [num_slots, 1, Dv], Dv < Dk; any strides (e.g. a view of K)
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, Dv]
    """Triton; reads no CPU metadata and copies no pool (strides go to the kernel)."""
    num_tokens, num_heads, k_dim = q.shape
    v_dim = v_pool.shape[-1]
    if k_pool.shape[1] != 1 or v_pool.shape[1] != 1:
        raise ValueError(f"MLA attention takes one kv head, got K {tuple(k_pool.shape)}")
    if not 0 < v_dim < k_dim or k_pool.shape[-1] != k_dim:
        raise ValueError(
            f"MLA attention needs V narrower than K and K as wide as q: q {k_dim}, "
            f"K {k_pool.shape[-1]}, V {v_dim}"
        )
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask.view(torch.uint8) if has_mask else meta.kv_indices
    mask_indptr = meta.mask_indptr if has_mask else meta.kv_indptr
    lat_pad, rope_pad = max(16, next_pow2(v_dim)), max(16, next_pow2(k_dim - v_dim))
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    dot_dtype, precision = dot_types(q)
    splits = num_splits or default_num_splits(num_tokens * head_blocks, q.device)
    part_m = part_l = part_acc = out  # unused when there is one split
    if splits > 1:
        part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, lat_pad, dtype=torch.float32, device=q.device)
    _mla_attention_kernel[(num_tokens, head_blocks, splits)](
        q, k_pool, v_pool, out, part_m, part_l, part_acc,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, mask, mask_indptr,
        meta.batch_size, num_heads, float(scale),
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(2), out.stride(0), out.stride(1),
        V_DIM=v_dim, ROPE_DIM=k_dim - v_dim, LAT_PAD=lat_pad, ROPE_PAD=rope_pad,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_BS=128, HAS_MASK=has_mask, NUM_SPLITS=splits,
        SHARED_V=v_is_k_latent(k_pool, v_pool), DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
    )  # fmt: skip
    if splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=v_dim, DIM_PAD=lat_pad, NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
        )  # fmt: skip
    return out


def mla_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, Dk]
    k_pool: torch.Tensor,  # [num_slots, 1, Dk]
    v_pool: torch.Tensor,  # [num_slots, 1, Dv]
    meta: AttentionMetadata,
    scale: float,
    impl: str = "torch",
) -> torch.Tensor:  # [num_tokens, num_heads, Dv]
    fn = pick_impl(impl, paged_attention_ref, mla_attention_triton)
    return fn(q, k_pool, v_pool, meta, scale)
