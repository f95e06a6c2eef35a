"""Paged attention over a ragged batch (extend, decode, tree verify, tree draft decode).

Contract (see ``runtime/attention/base.py`` for the layout): request b owns query rows
``qo_indptr[b]:qo_indptr[b+1]`` and KV slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, its new
tokens last and already written into the pools. Row i of request b sees kv column j iff
``j <= kv_len_b - q_len_b + i`` (no custom mask), else iff its row of the custom mask says so.
Softmax in fp32, output in q's dtype. GQA: query head h reads kv head ``h // (heads // kv_heads)``.

Triton launch (sync-free): one program per (query row, kv head, split), grid
``(num_tokens, num_kv_heads, num_splits)`` -- all known from tensor shapes, so no
``q_lens_cpu`` / ``max_*`` is needed. A program finds its request by counting the requests whose
rows end at or before its row (a vectorised scan of ``qo_indptr``), then runs an online softmax
over its split of that request's kv in ``BLOCK_N`` tiles for all ``group`` query heads sharing
the kv head. With more than one split (flash-decoding: few rows, as in decode at a small batch,
would leave most of a GPU idle), each split writes its unnormalised partial (max, sum, output)
and a second kernel merges them per (row, head).

With ``tiles="rows"`` the program of every ``BLOCK_Q``-th row of a request attends that row and
the next ``BLOCK_Q - 1`` of the same request at once (the other programs return at once):
a verify's tree rows read their request's kv once instead of once each (`rows_per_program`
picks ``BLOCK_Q`` from the batch's shape).

Tile kinds (``tiles``): "dot" (the default) multiplies on tensor cores with ``tl.dot``, the
group's query heads padded to 16 rows and the kv in 64-column tiles (fp32 inputs stay exact with
"ieee" products; half types round the probabilities to their type before the product with
V); "rows" is "dot" over several rows of a request; "fma" keeps every product elementwise in
fp32 over small tiles. Any head_dim (padded to a power of two and masked), any group size.
On an H200, 8B shapes, 32 layers (`bench.attention_speed`): decode at batch 32 over 512 tokens
3.65 -> 1.10 ms a step, a verify's 8-row trees at batch 8 7.65 -> 1.39 ms. Long prefills on a
GPU belong to the FlashInfer backend.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specmesh.kernels.common import next_pow2, pick_impl

if TYPE_CHECKING:  # a type only: kernels do not import the runtime
    from specmesh.runtime.attention.base import AttentionMetadata


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_pool: torch.Tensor,  # [num_slots, num_kv_heads, v_head_dim]; v_head_dim <= head_dim
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    """Plain torch, one request at a time. V may be narrower than K (multi-head latent
    attention, whose Triton kernel is `kernels.mla_attention`)."""
    group = q.shape[1] // k_pool.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for an fp64 check
    out = q.new_empty(*q.shape[:2], v_pool.shape[-1])
    qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    for b in range(meta.batch_size):
        q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        slots = meta.kv_indices[kv[b] : kv[b + 1]]
        keys = k_pool[slots].to(acc).repeat_interleave(group, dim=1)  # [kv_len, heads, head_dim]
        values = v_pool[slots].to(acc).repeat_interleave(group, dim=1)
        queries = q[qo[b] : qo[b + 1]].to(acc)  # [q_len, heads, head_dim]
        if meta.custom_mask is None:
            rows = torch.arange(q_len, device=q.device)[:, None]
            cols = torch.arange(kv_len, device=q.device)[None, :]
            visible = cols <= kv_len - q_len + rows  # [q_len, kv_len]
        else:
            start = int(meta.mask_indptr[b])
            visible = meta.custom_mask[start : start + q_len * kv_len].view(q_len, kv_len)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale  # [heads, q_len, kv_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


@triton.jit
def owning_request(qo_indptr, batch_size, row, BLOCK_BS: tl.constexpr):
    """The request query ``row`` belongs to: the number of requests whose rows end at or
    before it (a vectorised scan of ``qo_indptr``, no host metadata)."""
    b = tl.zeros((), tl.int64)
    for start in range(0, batch_size, BLOCK_BS):
        offs = start + tl.arange(0, BLOCK_BS)
        ends = tl.load(qo_indptr + 1 + offs, mask=offs < batch_size, other=row + 1)
        b += tl.sum((ends <= row).to(tl.int64), axis=0)
    return b


@triton.jit
def row_kv_span(
    qo_indptr, kv_indptr, mask_indptr, batch_size, row, split,
    HAS_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_BS: tl.constexpr,
):  # fmt: skip
    """What query ``row`` reads (shared by the kernels over the paged layout): its request's
    first kv entry, this split's kv columns ``[lo, hi)`` and where its custom-mask row starts
    (0 without a mask)."""
    b = owning_request(qo_indptr, batch_size, row, BLOCK_BS)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    i = row - q_start
    if HAS_MASK:
        mask_start = tl.load(mask_indptr + b) + i * kv_len
        kv_end = kv_len
    else:
        mask_start = tl.zeros((), tl.int64)
        kv_end = kv_len - q_len + i + 1
    # This program's share of the row's kv: whole tiles, the last split takes the remainder.
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    return kv_start, lo, hi, mask_start


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qo_indptr, kv_indptr, kv_indices, mask_ptr, mask_indptr,
    batch_size, num_heads, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_BS: tl.constexpr,
    HAS_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query row, kv head, split); the program of a request's row ``i`` with
    ``i % BLOCK_Q == 0`` attends rows ``i .. i + BLOCK_Q - 1`` of that request at once (their
    kv read once: a verify's tree rows share it), the others have nothing to do."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    b = owning_request(qo_indptr, batch_size, row, BLOCK_BS)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    i0 = row - q_start
    if i0 % BLOCK_Q == 0:
        kv_start = tl.load(kv_indptr + b)
        kv_len = tl.load(kv_indptr + b + 1) - kv_start
        # Rows of the block x heads of the group, flattened: M = BLOCK_Q * GROUP_PAD queries.
        m = tl.arange(0, BLOCK_Q * GROUP_PAD)
        i = i0 + m // GROUP_PAD
        g = m % GROUP_PAD
        ok = (i < q_len) & (g < GROUP)
        tok = q_start + i
        heads = kv_head * GROUP + g
        d = tl.arange(0, DIM_PAD)
        qd_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
        q_offs = tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        queries = tl.load(q_ptr + q_offs, mask=qd_mask, other=0.0)  # [M, D]
        queries = queries.to(DOT_DTYPE if USE_DOT else tl.float32)
        if HAS_MASK:
            kv_end = kv_len
            mask_row = tl.load(mask_indptr + b) + i * kv_len  # [M]
        else:  # causal: row i sees columns up to kv_len - q_len + i
            kv_end = kv_len - q_len + tl.minimum(i0 + BLOCK_Q, q_len)
        # This program's share of the block's kv: the last split takes the remainder.
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
        # A finite start keeps exp(m_old - m_new) defined when a whole tile is masked.
        m_i = tl.full((BLOCK_Q * GROUP_PAD,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_Q * GROUP_PAD,), tl.float32)
        acc = tl.zeros((BLOCK_Q * GROUP_PAD, DIM_PAD), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            slots = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0)
            kd_mask = col_ok[:, None] & (d < HEAD_DIM)[None, :]
            k_offs = slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            keys = tl.load(k_ptr + k_offs, mask=kd_mask, other=0.0)  # [N, D]
            v_offs = slots[:, None] * stride_vt + kv_head * stride_vh + d[None, :]
            values = tl.load(v_ptr + v_offs, mask=kd_mask, other=0.0)  # [N, D]
            if USE_DOT:  # tensor cores; fp32 stays exact ("ieee"), half types accumulate fp32
                keys, values = keys.to(DOT_DTYPE), values.to(DOT_DTYPE)
                scores = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION) * scale
            else:
                keys, values = keys.to(tl.float32), values.to(tl.float32)
                scores = tl.sum(queries[:, None, :] * keys[None, :, :], axis=2) * scale  # [M, N]
            visible = col_ok[None, :] & ok[:, None]
            if HAS_MASK:
                seen = tl.load(mask_ptr + mask_row[:, None] + cols[None, :], mask=visible, other=0)
                visible = visible & (seen != 0)
            elif BLOCK_Q > 1:  # one row alone reads only what it sees (hi)
                visible = visible & (cols[None, :] <= (kv_len - q_len + i)[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                pv = tl.dot(p.to(DOT_DTYPE), values, input_precision=DOT_PRECISION)
            else:
                pv = tl.sum(p[:, :, None] * values[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if NUM_SPLITS == 1:  # (rows past the request's see nothing: l = 0, not stored)
            out = acc / tl.where(ok, l_i, 1.0)[:, None]
            o_offs = tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
        else:  # unnormalised partials, combined by merge_splits_kernel
            part = (tok * num_heads + heads) * NUM_SPLITS + split  # [M]
            tl.store(part_m_ptr + part, m_i, mask=ok)
            tl.store(part_l_ptr + part, l_i, mask=ok)
            tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=qd_mask)


@triton.jit
def merge_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (row * num_heads + head) * NUM_SPLITS + s  # [S]
    ok = s < NUM_SPLITS
    m = tl.load(part_m_ptr + part, mask=ok, other=-1.0e30)
    w = tl.exp(m - tl.max(m, axis=0))  # an empty split (m = -1e30, l = 0) weighs nothing
    total = tl.sum(w * tl.load(part_l_ptr + part, mask=ok, other=0.0), axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / total  # [D]
    o_offs = row * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# tl.dot operand types per model dtype. Under the interpreter (CPU) numpy has no bf16: fp32.
DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
CPU_DOT_DTYPES = {**DOT_DTYPES, torch.bfloat16: tl.float32}
TILES = ("dot", "rows", "fma")
# The tiles a call that names none gets; SPECMESH_ATTENTION_TILES sets it per process (a
# benchmark's A/B across a cluster's services, docs/gpu.md).
DEFAULT_TILES = os.environ.get("SPECMESH_ATTENTION_TILES", "dot")
if DEFAULT_TILES not in TILES:
    raise ValueError(f"SPECMESH_ATTENTION_TILES must be one of {TILES}, got {DEFAULT_TILES!r}")


def rows_per_program(num_tokens: int, batch_size: int, group_pad: int) -> int:
    """Query rows of one request a "rows" program attends at once: the batch's mean rows per
    request (shapes only: a tree's rows in a verify, 1 in decode), at most 16 and at most 64
    query vectors with the group's heads (registers)."""
    mean = triton.cdiv(num_tokens, max(batch_size, 1))
    return min(next_pow2(mean), 16, max(1, 64 // group_pad))


def dot_types(q: torch.Tensor) -> tuple[tl.dtype, str]:
    """The operand type and precision of ``tl.dot`` for queries ``q``: fp32 stays exact
    ("ieee"), half types multiply on tensor cores and accumulate in fp32."""
    dtype = DOT_DTYPES[q.dtype] if q.device.type == "cuda" else CPU_DOT_DTYPES[q.dtype]
    return dtype, "ieee" if dtype == tl.float32 else "tf32"


def default_num_splits(num_programs: int, device: torch.device) -> int:
    """How many pieces each row's kv is cut into (flash-decoding): enough programs to fill a
    GPU when rows are few (decode at a small batch), from shapes alone. 1 on CPU, where the
    interpreter runs programs one by one."""
    if device.type != "cuda":
        return 1
    return max(1, min(32, next_pow2(2048 // max(num_programs, 1))))


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    tiles: str | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton; reads no CPU metadata (grid from shapes, see the module docstring). ``tiles``:
    "dot" (tensor-core products over 64-column tiles), "rows" (the same with several rows of a
    request per program: `rows_per_program`) or "fma" (elementwise fp32 products over small
    tiles); default `DEFAULT_TILES`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    q, k_pool, v_pool = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_pool, v_pool))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, heads, head_dim]
    if num_tokens == 0:
        return out
    has_mask = meta.custom_mask is not None
    mask = meta.custom_mask.view(torch.uint8) if has_mask else meta.kv_indices
    mask_indptr = meta.mask_indptr if has_mask else meta.kv_indptr
    kind = tiles or DEFAULT_TILES
    group_pad, dim_pad = next_pow2(group), next_pow2(head_dim)
    block_q = rows_per_program(num_tokens, meta.batch_size, group_pad) if kind == "rows" else 1
    if kind != "fma":  # tl.dot's smallest operand is 16 wide; keep a [BLOCK_N, D] tile near 8k
        group_pad, dim_pad = max(group_pad, 16 // block_q), max(16, dim_pad)
        block_n = min(64, max(16, next_pow2(8192 // dim_pad)))
    else:  # keep the [G, BLOCK_N, D] product tile near 8k elements (registers on a GPU)
        block_n = min(64, max(16, next_pow2(8192 // (group_pad * dim_pad))))
    dot_dtype, precision = dot_types(q)
    busy = max(meta.batch_size, triton.cdiv(num_tokens, block_q))  # programs with rows to do
    splits = num_splits or default_num_splits(busy * num_kv_heads, q.device)
    part_m = part_l = part_acc = out  # unused when there is one split
    if splits > 1:
        part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, dim_pad, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        q, k_pool, v_pool, out, part_m, part_l, part_acc,
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, mask, mask_indptr,
        meta.batch_size, num_heads, float(scale),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, DIM_PAD=dim_pad,
        BLOCK_N=block_n, BLOCK_BS=128, HAS_MASK=has_mask, NUM_SPLITS=splits,
        BLOCK_Q=block_q, USE_DOT=kind != "fma", SPLIT_ALIGN=16, DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
    )  # fmt: skip
    if splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
        )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_pool: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    impl: str = "torch",
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    fn = pick_impl(impl, paged_attention_ref, paged_attention_triton)
    return fn(q, k_pool, v_pool, meta, scale)
