"""One builder per draft kind; each returns a `Drafter` with its own KV cache."""

from __future__ import annotations

import torch

from specmesh.draft_service.drafter import TreeDrafter
from specmesh.draft_service.feature_drafter import FeatureDrafter
from specmesh.draft_service.runtime import DraftConfig
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.config import parse_dtype
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.loader import load_tensors


def target_embedding(cfg: DraftConfig, target_model: torch.nn.Module | None) -> torch.nn.Embedding:
    """The target's token embedding: shared in process, read from the target checkpoint else."""
    if target_model is not None:
        return target_model.embed_tokens
    weight = load_tensors(cfg.target_dir, ["model.embed_tokens.weight"])[
        "model.embed_tokens.weight"
    ]
    return torch.nn.Embedding.from_pretrained(weight.to(cfg.device), freeze=True)


def make_cache(
    cfg: DraftConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> KVCache:
    return KVCache(
        num_layers=num_layers,
        num_slots=cfg.num_kv_slots,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=cfg.device,
        max_requests=cfg.max_requests,
        max_context=cfg.max_context,
    )


def build_eagle3(cfg: DraftConfig, target_model: torch.nn.Module | None) -> TreeDrafter:
    from specmesh.draft_service.models.eagle3 import load_eagle3

    dtype = parse_dtype(cfg.dtype) if cfg.dtype else None
    embed = target_embedding(cfg, target_model)
    net = load_eagle3(cfg.draft_dir, embed, dtype=dtype, aux_convention=cfg.aux_convention).to(
        cfg.device
    )
    b = net.config.base
    cache = make_cache(cfg, 1, b.num_kv_heads, b.head_dim, b.dtype)
    drafter = FeatureDrafter(net, cache, make_backend(cfg.attention_backend), cfg.spec, "aux")
    drafter.aux_layers = net.config.aux_layers
    return drafter


BUILDERS = {"eagle3": build_eagle3}


def build_drafter(cfg: DraftConfig, target_model: torch.nn.Module | None):
    if cfg.kind not in BUILDERS:
        raise ValueError(f"draft kind {cfg.kind!r} is not built yet")
    return BUILDERS[cfg.kind](cfg, target_model)
