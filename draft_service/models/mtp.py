"""Multi-layer EAGLE / DeepSeek-style MTP draft network: ``L`` next-token layers, one per step.

Layer i (DeepSeek-V3 "nextn" layer):

    u  = eh_proj(cat(enorm(embed(x)), hnorm(h)))      2H -> H, embedding first, no bias
    h' = block(u)                                      a Llama decoder layer (input norm included)
    logits = target_lm_head(shared_head.norm(h'))      the target's head; h' feeds the next layer

Layer 0 takes the target's hidden state BEFORE its final norm; layer i takes layer i-1's h'.

Checkpoint layout (close to DeepSeek-V3, where the MTP module is stored after the main stack):
``config.json`` holds the target's dimensions, ``num_hidden_layers = N`` (the target's layer count)
and ``num_nextn_predict_layers = L``; layer i's tensors are named ``model.layers.{N+i}.``:

    enorm.weight [H]   hnorm.weight [H]   eh_proj.weight [H, 2H]   shared_head.norm.weight [H]
    input_layernorm.weight, self_attn.{q,k,v,o}_proj.weight, post_attention_layernorm.weight,
    mlp.{gate,up,down}_proj.weight                     (the Llama / Qwen block)

``embed_tokens.weight`` and ``shared_head.head.weight`` copies, if present, are ignored: the
target's embedding and head are used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specmesh.draft_service.models.common import resolve_draft_base
from specmesh.draft_service.models.eagle1 import SharedHead
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    ModelConfig,
    read_config_json,
)
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.layers import DecoderLayer, KVPair, RMSNorm, Rotary, attention_shape

MTP_ARCHITECTURES = ("LlamaForCausalLMMTP", *SUPPORTED_ARCHITECTURES)


@dataclass(frozen=True)
class MTPConfig:
    base: ModelConfig  # one MTP layer's dimensions and RoPE
    first_layer: int  # N: layer i is stored as model.layers.{N + i}
    num_layers: int  # L = num_nextn_predict_layers


def parse_mtp_config(draft_dir: str | Path) -> MTPConfig:
    raw = read_config_json(draft_dir)
    base = ModelConfig.from_dict(raw, architectures=MTP_ARCHITECTURES)
    num = int(raw.get("num_nextn_predict_layers") or 0)
    if num < 1:
        raise CheckpointError(f"{draft_dir}: config.json needs num_nextn_predict_layers >= 1")
    return MTPConfig(replace(base, num_layers=num), base.num_layers, num)


class _SharedHeadNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(DecoderLayer):
    """A decoder block plus the MTP input projection and the pre-head norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(attention_shape(cfg), cfg.intermediate_size)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = _SharedHeadNorm(h, eps)


class MTPDraft(nn.Module):
    def __init__(self, cfg: MTPConfig, shared: SharedHead) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(MTPLayer(cfg.base) for _ in range(cfg.num_layers))
        self.rotary = Rotary(cfg.base.rope, cfg.base.head_dim)
        self._shared = [shared]  # a list, so the target's tensors stay out of the state dict

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0].embed(input_ids)

    def forward_layer(
        self,
        layer: int,
        positions: torch.Tensor,
        kv_pools: list[KVPair],  # exactly one: this layer's own pool
        backend: AttentionBackend,
        hidden_in: torch.Tensor,  # [num_tokens, H]: target pre-norm hidden or layer-1 output
        input_ids: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,  # [num_tokens, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.layers[layer]
        dtype = m.eh_proj.weight.dtype
        embeds = self.embed(input_ids) if input_embeds is None else input_embeds
        u = m.eh_proj(torch.cat([m.enorm(embeds.to(dtype)), m.hnorm(hidden_in.to(dtype))], -1))
        h = m(u, positions, self.rotary, kv_pools[0], backend)  # [num_tokens, H]
        return h, self._shared[0].logits(m.shared_head.norm(h))

    def layer_net(self, layer: int) -> _LayerNet:
        return _LayerNet(self, layer)


class _LayerNet:
    """One MTP layer seen as a draft network (the interface `forward_draft` calls)."""

    def __init__(self, draft: MTPDraft, layer: int) -> None:
        self.draft, self.layer = draft, layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.embed(input_ids)

    def __call__(self, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft.forward_layer(self.layer, **kwargs)


def load_mtp(
    draft_dir: str | Path, shared: SharedHead, *, dtype: torch.dtype | None = None
) -> MTPDraft:
    cfg = parse_mtp_config(draft_dir)
    width = shared.embed_tokens.weight.shape[1]
    cfg = replace(cfg, base=resolve_draft_base(draft_dir, cfg.base, dtype, width))
    model = MTPDraft(cfg, shared).to(cfg.base.dtype)
    model.rotary = Rotary(cfg.base.rope, cfg.base.head_dim)  # inv_freq stays fp32
    tensors = {}
    for name, t in load_tensors(draft_dir).items():
        parts = name.removeprefix("model.").split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
            i = int(parts[1]) - cfg.first_layer
            if 0 <= i < cfg.num_layers:
                tensors[f"layers.{i}.{parts[2]}"] = t
    assign_parameters(model, tensors, what=str(draft_dir))
    return model.requires_grad_(False).eval()
