"""A mixture of experts' routed experts without a host sync: each (token, chosen expert) pair is
multiplied by its own expert's weights, read by index from the layer's stacked weights. The
path a CUDA graph captures when the pairs are fewer than the experts (decode: it reads only
the chosen experts, where running every expert reads them all); `runtime.models.moe`.

Contract: ``x`` [T, H]; ``w13`` [E, 2I, H], each expert's gate rows then its up rows; ``w2``
[E, H, I]; ``ids`` [T, k] int64, a token's experts distinct; ``weights`` [T, k] fp32. Returns
[T, H] in ``x``'s dtype: per token, over its experts in ascending id order,
``sum weight * down(silu(gate x) * up x)``, each term rounded to ``x``'s dtype before it is
added, as the routed path adds them (`MoE.forward`). Products accumulate in fp32.

Triton (sync-free, grid from shapes): `_gate_up_kernel` writes ``silu(gate x) * up x`` of every
pair, one program per (pair, block of the intermediate size); `_down_kernel` its down
projection times the pair's weight, one program per (pair, block of the hidden size); the
k terms of a token are then added in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specmesh.kernels.common import pick_impl

BLOCK_OUT = 32  # output rows per program
BLOCK_IN = 128  # reduction columns per tile


def _pairs(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights in ascending expert order (the routed path's)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _sum_terms(terms: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``terms`` [T * k, H] (token-major) added per token in order, into zeros like ``x``."""
    terms = terms.view(x.shape[0], -1, x.shape[1])
    out = torch.zeros_like(x)
    for j in range(terms.shape[1]):
        out += terms[:, j]
    return out


def routed_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Plain torch: every pair's expert weights gathered, then batched products."""
    ids, weights = _pairs(ids, weights)
    k, inter = ids.shape[1], w2.shape[-1]
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, 0)[:, :, None]  # [T * k, H, 1]
    gate_up = torch.bmm(w13[flat], xs).squeeze(-1)  # [T * k, 2I]
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch.bmm(w2[flat], h[:, :, None]).squeeze(-1)  # [T * k, H]
    return _sum_terms((y * weights.reshape(-1, 1)).to(x.dtype), x)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, h_ptr, hidden, inter, K: tl.constexpr,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    expert = tl.load(ids_ptr + pair)
    base = w13_ptr + expert * 2 * inter * hidden
    row_ok = rows < inter
    gate = tl.zeros((BLOCK_OUT,), tl.float32)
    up = tl.zeros((BLOCK_OUT,), tl.float32)
    for start in range(0, hidden, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        col_ok = cols < hidden
        xv = tl.load(x_ptr + (pair // K) * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * hidden + cols[None, :]
        wg = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
        wu = tl.load(base + inter * hidden + offs, mask=ok, other=0.0).to(tl.float32)
        gate += tl.sum(wg * xv[None, :], axis=1)
        up += tl.sum(wu * xv[None, :], axis=1)
    dtype = h_ptr.dtype.element_ty  # rounded where the routed path rounds (its dtype)
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = silu * up.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * inter + rows, h.to(dtype), mask=row_ok)


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, ids_ptr, weights_ptr, y_ptr, hidden, inter,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    expert = tl.load(ids_ptr + pair)
    base = w2_ptr + expert * hidden * inter
    row_ok = rows < hidden
    acc = tl.zeros((BLOCK_OUT,), tl.float32)
    for start in range(0, inter, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        col_ok = cols < inter
        hv = tl.load(h_ptr + pair * inter + cols, mask=col_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        w = tl.load(base + rows[:, None] * inter + cols[None, :], mask=ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)
    tl.store(y_ptr + pair * hidden + rows, y.to(dtype), mask=row_ok)


def routed_experts_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Triton; reads only the chosen experts' weights, no host sync."""
    ids, weights = _pairs(ids, weights)
    num_tokens, k = ids.shape
    hidden, inter = x.shape[1], w2.shape[-1]
    pairs = num_tokens * k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = ids.contiguous(), weights.float().contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs:
        _gate_up_kernel[(pairs, triton.cdiv(inter, BLOCK_OUT))](
            x, w13, ids, h, hidden, inter, K=k, BLOCK_OUT=BLOCK_OUT, BLOCK_IN=BLOCK_IN
        )
        _down_kernel[(pairs, triton.cdiv(hidden, BLOCK_OUT))](
            h, w2, ids, weights, y, hidden, inter, BLOCK_OUT=BLOCK_OUT, BLOCK_IN=BLOCK_IN
        )
    return _sum_terms(y, x)


def routed_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    impl: str = "torch",
) -> torch.Tensor:
    fn = pick_impl(impl, routed_experts_ref, routed_experts_triton)
    return fn(x, w13, w2, ids, weights)
