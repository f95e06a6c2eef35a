"""EAGLE-3 draft network in the SpecForge / SGLang checkpoint format.

    g   = fc(aux)                     first step only (aux = [low, mid, high] target states, 3·Ht)
    u   = [input_layernorm(embed(x_{t+1})), hidden_norm(g)]        2H, embedding first
    r   = g + o_proj(attn(u))         causal over the draft's own KV (RoPE from the draft config)
    y   = r + mlp(post_attention_layernorm(r))      fed back as the next step's hidden (pre-norm)
    logits = lm_head(norm(y))         over the draft vocab; target id = draft id + d2t[draft id]

The token embedding is the target's (EAGLE-3 checkpoints ship none).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specmesh.draft_service.models.common import resolve_draft_base
from specmesh.protocol.features import AuxLayers
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import ModelConfig, read_config_json
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.layers import MLP, Attention, AttentionShape, KVPair, RMSNorm, Rotary

EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLM",
    "Eagle3Speculator",
    "Eagle3DraftModel",
)


@dataclass(frozen=True)
class Eagle3Config:
    base: ModelConfig  # the single draft layer's dimensions and RoPE
    target_hidden_size: int
    draft_vocab_size: int
    aux_layers: AuxLayers | None  # None = the target's default capture
    fc_bias: bool = False


def parse_eagle3_config(draft_dir: str | Path, aux_convention: str = "output") -> Eagle3Config:
    raw = read_config_json(draft_dir)
    if "transformer_layer_config" in raw:  # speculators format: layer config nested
        raw = {
            **raw["transformer_layer_config"],
            **{k: v for k, v in raw.items() if k != "transformer_layer_config"},
        }
    base = ModelConfig.from_dict(raw, architectures=EAGLE3_ARCHITECTURES)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or raw.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return Eagle3Config(
        base=replace(base, num_layers=1),
        target_hidden_size=int(raw.get("target_hidden_size") or base.hidden_size),
        draft_vocab_size=int(raw.get("draft_vocab_size") or base.vocab_size),
        aux_layers=AuxLayers(tuple(ids), aux_convention) if ids else None,
        fc_bias=bool(raw.get("bias", False)),
    )


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        shape = AttentionShape(
            h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rms_norm_eps=eps, input_size=2 * h
        )
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        b = cfg.base
        self.config = cfg
        self.hidden_size = b.hidden_size
        num_aux = len(cfg.aux_layers.layer_ids) if cfg.aux_layers else 3
        self.fc = nn.Linear(num_aux * cfg.target_hidden_size, b.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3MidLayer(b)
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.lm_head = nn.Linear(b.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rotary = Rotary(b.rope, b.head_dim)
        self._embed = [embed_tokens]  # shared with the target, not a parameter of the draft

    @property
    def feature_width(self) -> int:
        """Width of the target features an extend row takes: the concatenated aux states."""
        return self.fc.in_features

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed[0](input_ids)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        positions: torch.Tensor,
        kv_pools: list[KVPair],
        backend: AttentionBackend,
        hidden_in: torch.Tensor,  # [num_tokens, 3·Ht] (first step) or [num_tokens, H]
        input_ids: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,  # [num_tokens, H], rotated target mm embeds
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(input_ids) if input_embeds is None else input_embeds
        g = (
            hidden_in
            if hidden_in.shape[-1] == self.hidden_size
            else self.fc(hidden_in.to(self.fc.weight.dtype))
        )
        layer = self.midlayer
        u = torch.cat([layer.input_layernorm(embeds.to(g.dtype)), layer.hidden_norm(g)], dim=-1)
        r = g + layer.self_attn(u, positions, self.rotary, kv_pools[0], backend)
        y = r + layer.mlp(layer.post_attention_layernorm(r))
        return y, (self.norm(y) @ self.lm_head.weight.t()).float()


def load_eagle3(
    draft_dir: str | Path,
    embed_tokens: nn.Embedding,
    *,
    dtype: torch.dtype | None = None,
    aux_convention: str = "output",
) -> Eagle3Draft:
    cfg = parse_eagle3_config(draft_dir, aux_convention)
    width = embed_tokens.weight.shape[1]
    cfg = replace(cfg, base=resolve_draft_base(draft_dir, cfg.base, dtype, width))
    model = Eagle3Draft(cfg, embed_tokens).to(cfg.base.dtype)
    model.rotary = Rotary(cfg.base.rope, cfg.base.head_dim)  # inv_freq stays fp32
    tensors = {k.removeprefix("model."): v for k, v in load_tensors(draft_dir).items()}
    tensors = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
    }
    tensors.pop("t2d", None)
    tensors.pop("embed_tokens.weight", None)
    tensors.setdefault(
        "d2t",
        tensors.pop("draft_id_to_target_id", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)),
    )
    assign_parameters(model, tensors, what=str(draft_dir))
    model.d2t.copy_(tensors["d2t"].to(torch.int64))
    return model.requires_grad_(False).eval()
