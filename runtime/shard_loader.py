"""Per-rank weight loading: each rank reads only its slice of each tensor, straight from the
safetensors files (``safe_open(...).get_slice(name)[a:b]``), never the full tensor. Which slice
follows the layout in `runtime.parallel`; tensors no rule names (norms) are read whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specmesh.runtime.config import CheckpointError, ModelConfig
from specmesh.runtime.loader import checkpoint_files
from specmesh.runtime.parallel import TensorParallel, kv_head_range, vocab_range


@dataclass(frozen=True)
class Shard:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, start + size)`` of a stored tensor; past
    the stored extent (vocabulary padding) the slice is filled with zeros."""

    dim: int
    start: int
    size: int


def shard_of(name: str, cfg: ModelConfig, tp: TensorParallel) -> Shard | None:
    """This rank's slice of checkpoint tensor ``name``; None = the whole tensor."""
    if cfg.mla is not None and (latent := _latent_shard(name, cfg, tp)) is not None:
        return latent
    d = cfg.head_dim
    heads = cfg.num_heads // tp.world_size
    kv_start, kv_count = kv_head_range(cfg.num_kv_heads, tp)
    inter = cfg.intermediate_size // tp.world_size
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return Shard(0, tp.rank * heads * d, heads * d)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return Shard(0, kv_start * d, kv_count * d)
    if name.endswith("self_attn.o_proj.weight"):
        return Shard(1, tp.rank * heads * d, heads * d)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return Shard(0, tp.rank * inter, inter)
    if name.endswith("mlp.down_proj.weight"):
        return Shard(1, tp.rank * inter, inter)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return Shard(0, *vocab_range(cfg.vocab_size, tp))
    return None


def _latent_shard(name: str, cfg: ModelConfig, tp: TensorParallel) -> Shard | None:
    """MLA heads and experts (`runtime.parallel`); None: the generic rules decide."""
    m, heads, r = cfg.mla, cfg.num_heads // tp.world_size, tp.rank
    assert m is not None
    per_head = {
        "self_attn.q_proj.weight": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "self_attn.q_b_proj.weight": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "self_attn.kv_b_proj.weight": m.qk_nope_head_dim + m.v_head_dim,
    }
    for suffix, width in per_head.items():
        if name.endswith(suffix):
            return Shard(0, r * heads * width, heads * width)
    if name.endswith("self_attn.o_proj.weight"):
        return Shard(1, r * heads * m.v_head_dim, heads * m.v_head_dim)
    if cfg.moe is None or not (".experts." in name or ".shared_experts." in name):
        return None
    inter = cfg.moe.moe_intermediate_size // tp.world_size
    if ".shared_experts." in name:
        inter *= cfg.moe.n_shared_experts
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return Shard(0, r * inter, inter)
    if name.endswith("down_proj.weight"):
        return Shard(1, r * inter, inter)
    return None


def load_shard_tensors(
    model_dir: str | Path, wanted: Mapping[str, object], cfg: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """This rank's slices of the tensors named in ``wanted`` (a state dict's keys), on CPU in
    their stored dtype; names the checkpoint lacks are left out (the caller reports them)."""
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in wanted:
                    out[name] = _read(f.get_slice(name), shard_of(name, cfg, tp), name)
    return out


def _read(view, shard: Shard | None, name: str) -> torch.Tensor:
    if shard is None:
        return view[:]
    shape = view.get_shape()
    if shard.dim >= len(shape):
        raise CheckpointError(f"tensor {name!r} has shape {shape}; cannot split dim {shard.dim}")
    end = min(shard.start + shard.size, shape[shard.dim])
    if end <= shard.start:  # a rank holding vocabulary padding only
        return torch.zeros(_with(shape, shard.dim, shard.size), dtype=view[0:0].dtype)
    part = view[shard.start : end] if shard.dim == 0 else view[:, shard.start : end]
    missing = shard.size - part.shape[shard.dim]
    if missing > 0:  # the last rank's vocabulary padding
        pad = part.new_zeros(_with(part.shape, shard.dim, missing))
        part = torch.cat([part, pad], dim=shard.dim)
    return part


def _with(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out
