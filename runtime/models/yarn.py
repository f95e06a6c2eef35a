"""YaRN RoPE scaling (https://arxiv.org/abs/2309.00071) as transformers computes it
(``_compute_yarn_parameters``), and DeepSeek's softmax correction.

Three numbers come out of one `RopeConfig`:

- the inverse frequencies: each of the ``dim / 2`` frequencies is interpolated (divided by
  ``factor``) or kept (extrapolated), with a linear ramp between the dims that turn fewer than
  ``beta_fast`` and more than ``beta_slow`` times over ``original_max_position`` tokens;
- ``attention_factor``, which multiplies cos and sin (so q·k by its square): the config's value,
  else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
  ``mscale(factor)``;
- DeepSeek's softmax scale ``qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2`` when
  the config has a non-zero ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``).
"""

from __future__ import annotations

import math

import torch

from specmesh.runtime.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """``[dim / 2]`` fp32 inverse frequencies."""

    def correction_dim(num_rotations: float) -> float:
        turns = rope.original_max_position / (num_rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: 1 except under YaRN."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """DeepSeek's attention scale: from the un-absorbed q·k width (nope + rope dims), times
    ``mscale(factor, mscale_all_dim) ** 2`` under a scaled RoPE with ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale
