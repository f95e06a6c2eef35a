"""One builder per draft kind; each returns a `Drafter` with its own KV cache."""

from __future__ import annotations

import torch

from specmesh.draft_service.drafter import TreeDrafter
from specmesh.draft_service.feature_drafter import FeatureDrafter
from specmesh.draft_service.runtime import Drafter
from specmesh.protocol.config import DraftConfig
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.config import parse_dtype
from specmesh.runtime.kv_budget import kv_slots, slot_bytes
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.llava_checkpoint import language_model_tensors, target_model_config


def target_embedding(cfg: DraftConfig, target_model: torch.nn.Module | None) -> torch.nn.Embedding:
    """The target's token embedding: shared in process, read from the target checkpoint else."""
    if target_model is not None:
        return target_model.embed_tokens
    name = "model.embed_tokens.weight"
    weight = language_model_tensors(cfg.target_dir, [name])[name]
    return torch.nn.Embedding.from_pretrained(weight.to(cfg.device), freeze=True)


def make_cache(
    cfg: DraftConfig,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    latent_dim: int | None = None,
) -> KVCache:
    """The draft's own KV cache; ``latent_dim``: multi-head latent attention pools (V inside K)."""
    per_slot = slot_bytes(num_layers, num_kv_heads, head_dim, dtype, latent_dim is not None)
    num_slots = kv_slots(cfg.num_kv_slots, cfg.kv_cache_memory, per_slot, 1, cfg.device,
                         cfg.max_context)  # fmt: skip
    return KVCache(
        num_layers=num_layers,
        num_slots=num_slots,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=cfg.device,
        max_requests=cfg.max_requests,
        max_context=cfg.max_context,
        latent_dim=latent_dim,
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
    backend = make_backend(cfg.attention_backend, cfg.device, b.head_dim, b.dtype)
    aux = net.config.aux_layers
    return FeatureDrafter(net, cache, backend, cfg.spec, FeatureSpec(Feature.AUX_HIDDEN, aux))


def target_shared_head(cfg: DraftConfig, target_model: torch.nn.Module | None):
    """The target's embedding and LM head (EAGLE-1 and MTP drafts ship neither): shared in
    process, else read from the target checkpoint (``lm_head.weight``, or the tied embedding)."""
    from specmesh.draft_service.models.eagle1 import SharedHead

    if target_model is not None:
        return SharedHead(target_model.embed_tokens, target_model.head_weight)
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    tensors = {
        k: v.to(cfg.device) for k, v in language_model_tensors(cfg.target_dir, names).items()
    }
    embed = torch.nn.Embedding.from_pretrained(tensors[names[0]], freeze=True)
    return SharedHead(embed, tensors.get("lm_head.weight", tensors[names[0]]))


def build_eagle(cfg: DraftConfig, target_model: torch.nn.Module | None) -> TreeDrafter:
    from specmesh.draft_service.models.eagle1 import load_eagle1

    dtype = parse_dtype(cfg.dtype) if cfg.dtype else None
    net = load_eagle1(cfg.draft_dir, target_shared_head(cfg, target_model), dtype=dtype)
    b = net.config.base
    cache = make_cache(cfg, 1, b.num_kv_heads, b.head_dim, b.dtype)
    backend = make_backend(cfg.attention_backend, cfg.device, b.head_dim, b.dtype)
    return FeatureDrafter(net.to(cfg.device), cache, backend, cfg.spec, FeatureSpec(Feature.HIDDEN))


def build_mtp(cfg: DraftConfig, target_model: torch.nn.Module | None) -> TreeDrafter:
    """Multi-layer EAGLE / MTP layers, one KV pool each. A DeepSeek-V3 checkpoint (``--draft-model``
    = the target's own directory) gives its NextN layers: MLA blocks over latent pools, so the
    backend must run latent attention (torch or triton, not yet flashinfer)."""
    from specmesh.draft_service.models.mtp import load_mtp
    from specmesh.draft_service.mtp_drafter import MTPDrafter

    dtype = parse_dtype(cfg.dtype) if cfg.dtype else None
    net = load_mtp(cfg.draft_dir, target_shared_head(cfg, target_model), dtype=dtype)
    b = net.config.base
    num_pools = MTPDrafter.num_active_layers(net.config.num_layers, cfg.spec)
    cache = make_cache(cfg, num_pools, b.num_kv_heads, b.head_dim, b.dtype, b.kv_latent_dim)
    backend = make_backend(
        cfg.attention_backend, cfg.device, b.head_dim, b.dtype, latent=b.mla is not None
    )
    return MTPDrafter(net.to(cfg.device), cache, backend, cfg.spec)


def build_standalone(cfg: DraftConfig, target_model: torch.nn.Module | None) -> TreeDrafter:
    from specmesh.draft_service.standalone import StandaloneDrafter
    from specmesh.runtime.models.causal_lm import load_causal_lm

    dtype = parse_dtype(cfg.dtype) if cfg.dtype else None
    model = load_causal_lm(cfg.draft_dir, dtype=dtype, device=cfg.device)
    c = model.config
    target_vocab = (
        target_model.config.vocab_size
        if target_model is not None
        else target_model_config(cfg.target_dir).vocab_size
    )
    # a multi-head latent attention model (DeepSeek) keeps its KV as the target does
    cache = make_cache(cfg, c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, c.kv_latent_dim)
    latent = c.mla is not None
    backend = make_backend(cfg.attention_backend, cfg.device, c.head_dim, c.dtype, latent=latent)
    return StandaloneDrafter(model, cache, backend, cfg.spec, target_vocab)


def build_ngram(cfg: DraftConfig, target_model: torch.nn.Module | None) -> Drafter:
    from specmesh.draft_service.ngram import NgramDrafter

    return NgramDrafter(cfg.spec)


BUILDERS = {
    "eagle3": build_eagle3,
    "eagle": build_eagle,
    "mtp": build_mtp,
    "standalone": build_standalone,
    "ngram": build_ngram,
}


def build_drafter(cfg: DraftConfig, target_model: torch.nn.Module | None) -> Drafter:
    if cfg.kind not in BUILDERS:
        raise ValueError(f"draft kind {cfg.kind!r} is not built yet")
    return BUILDERS[cfg.kind](cfg, target_model)
