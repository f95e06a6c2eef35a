"""The seeded draw: Gumbel-max with noise keyed by (seed, output position, token id).

Contract. For a row with processed scores ``s`` (``log p`` up to a per-row constant: the
tempered logits, ``-inf`` where top-k / top-p / min_p / a grammar removed a token) and key
``k = row_keys(seed, position)``, the draw is::

    argmax_t  s[t] + G(k, t)        G(k, t) = -log(-log(u(k, t)))   (first index on a tie)

where ``u(k, t)`` is a uniform in (0, 1) from a counter-based hash of the key and the token id:
it depends on nothing else (no state, no order, no batch, no device).

Lossless: the ``G(k, t)`` of one row stand for independent standard Gumbel variables, and the
argmax of ``log p + G`` is distributed as ``p`` (the Gumbel-max trick); keys differ across
positions, so draws at different positions are independent too. The stand-in's departures: ``u``
takes 2**32 levels (``G`` within [-3.13, 22.9]: tails of probability 1.2e-10 each cut), and a
row's 32-bit hashes are distinct (the mixer is a bijection). `tests/unit/test_seeded_sampling.py`
checks draws and their independence across positions with chi-square tests.

Stable: if every score moves by at most ``d``, a draw changes only where the top two of
``s + G`` were within ``2 d``: two tokens near a tie in the race, whatever their ids. (A
truncation boundary of top-k / top-p / min_p can also move; that changes the draw only if the
token crossing it wins the race.) Walking the CDF in token-id order instead let one rounding in
any earlier token's probability move the boundary between two neighbouring ids, whatever their
probabilities, so flips grew with the vocabulary (`tests/unit/test_draw_stability.py`).

Bit-exactness (torch reference vs Triton kernel, CPU vs GPU): the hash is integer arithmetic on
values below 2**32 held in int64 (every product stays below 2**63, so nothing wraps);
``u = (h + 0.5) / 2**32`` is exact in float64; ``G`` is two float64 logs rounded once to float32,
and ``s + G`` one float32 add; both implementations do exactly these operations, and both keep
the first maximal index. Float64 logs of different math libraries may differ in the last bit
(torch's CPU log and numpy's, which the Triton interpreter uses, do for 0.4% of 10M values);
the rounding to float32 absorbs that (no float32 value differed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from specmesh.kernels.common import pick_impl

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SPLIT1, _SPLIT2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# The 32-bit mixer's multipliers: odd (so each step is a bijection of [0, 2**32)) and below
# 2**31 (so a product of a 32-bit value with one stays below 2**63 in int64).
MUL1, MUL2, MASK32 = 0x7FEB352D, 0x2C1B3C6D, 0xFFFFFFFF
# The same for the Triton kernels: a compiled kernel reads only globals made `tl.constexpr`
# (the interpreter, which the CPU tests run, reads any).
_MUL1, _MUL2, _MASK32 = tl.constexpr(MUL1), tl.constexpr(MUL2), tl.constexpr(MASK32)
_REF_BLOCK_ELEMS = 1 << 20  # scores the torch reference races at once


def row_keys(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One 64-bit key per (seed, output position) ``[rows] int64`` (the bits of a uint64):
    splitmix64 of the pair, computed on the host."""
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = (s * _GOLDEN + p) * _GOLDEN + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _SPLIT1
        x = (x ^ (x >> np.uint64(27))) * _SPLIT2
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy(x.view(np.int64).copy())


# ---------------------------------------------------------------- torch reference


def _mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) in int64 lanes, in place: xor-shift, multiply, xor-shift,
    multiply, xor-shift."""
    x ^= x >> 16
    x.mul_(MUL1).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(MUL2).bitwise_and_(MASK32)
    x ^= x >> 16
    return x


def gumbel_noise_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``G(k, t)`` for every row key and token id: ``[rows, vocab]`` float32."""
    lo = (keys & MASK32)[:, None]  # [rows, 1]
    hi = ((keys >> 32) & MASK32)[:, None]
    tokens = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    h = _mix32_ref(tokens ^ lo)  # [rows, vocab], values in [0, 2**32)
    h ^= hi
    u = _mix32_ref(h).double().add_(0.5).mul_(2.0**-32)  # exact: h + 0.5 < 2**53
    return u.log_().neg_().log_().neg_().float()


def gumbel_argmax_ref(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax_t scores[r, t] + G(keys[r], t)`` per row: ``[rows] int64``. ``scores``
    ``[rows, vocab]`` float32, ``keys`` ``[rows]`` int64 (`row_keys`), on one device. A few
    rows at a time, so the noise of a block stays in cache (six times faster on a CPU at a
    152k vocabulary than the whole batch at once)."""
    rows, vocab = scores.shape
    step = max(1, _REF_BLOCK_ELEMS // max(vocab, 1))
    out = torch.zeros(rows, dtype=torch.int64, device=scores.device)  # [rows]
    for r in range(0, rows, step):
        noise = gumbel_noise_ref(keys[r : r + step], vocab)
        out[r : r + step] = noise.add_(scores[r : r + step]).argmax(-1)
    return out


# ---------------------------------------------------------------- Triton (row x split)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(
    scores, keys, best_value, best_index, vocab, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    """The winner of one row's race over one split of the vocabulary ``[SPLIT]``."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    key = tl.load(keys + row)
    lo = key & _MASK32
    hi = (key >> 32) & _MASK32
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = split * SPLIT
    for start in range(0, SPLIT, BLOCK):
        base = split * SPLIT + start
        cols = base + tl.arange(0, BLOCK).to(tl.int64)
        ok = cols < vocab
        s = tl.load(scores + row * vocab + cols, mask=ok, other=float("-inf"))
        h = _mix32(_mix32(cols ^ lo) ^ hi)
        u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2**-32
        g = (-tl.log(-tl.log(u))).to(tl.float32)
        value, idx = tl.max(g + s, 0, return_indices=True, return_indices_tie_break_left=True)
        take = value > best  # strictly: an earlier block keeps a tie (the first index wins)
        best = tl.where(take, value, best)
        best_idx = tl.where(take, base + idx.to(tl.int64), best_idx)
    out = row * tl.num_programs(1) + split
    tl.store(best_value + out, best)
    tl.store(best_index + out, best_idx)


_SPLIT, _BLOCK = 16384, 2048  # vocabulary per program, per step of its loop


def gumbel_argmax_triton(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each program races one split of one row; the first split holding a row's maximum
    holds its first maximal index, so an argmax over the splits finishes the race."""
    rows, vocab = scores.shape
    block = min(_BLOCK, triton.next_power_of_2(max(vocab, 1)))
    split = min(_SPLIT, triton.cdiv(vocab, block) * block)
    num_splits = triton.cdiv(vocab, split)
    dev = scores.device
    value = torch.empty(rows, num_splits, dtype=torch.float32, device=dev)  # [rows, splits]
    index = torch.empty(rows, num_splits, dtype=torch.int64, device=dev)  # [rows, splits]
    if rows:
        grid = (rows, num_splits)
        _race_kernel[grid](
            scores.contiguous(), keys.contiguous(), value, index, vocab, split, block
        )
    return index.gather(-1, value.argmax(-1, keepdim=True)).squeeze(-1)


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """The seeded draw of each row (module docstring): ``[rows] int64``."""
    return pick_impl(impl, gumbel_argmax_ref, gumbel_argmax_triton)(scores, keys)
