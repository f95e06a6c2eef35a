"""EAGLE-1 / EAGLE-2 draft network in the SafeAILab / SGLang checkpoint format.

    u = fc(cat(embed(x_{t+1}), f_t))     2H -> H, embedding first; f_t = the target's final hidden
                                         state after its norm (step 0) or the draft's own output y
    y = layers.0(u)                      a Llama decoder layer WITHOUT input_layernorm
    logits = target_lm_head(y)           no draft norm, no draft head

Tensors: ``fc.weight`` [H, 2H] (+ ``fc.bias`` [H] when ``"bias": true``), ``layers.0.*`` without
``input_layernorm``; an ``embed_tokens.weight`` copy of the target's, if shipped, is ignored. The
token embedding and the LM head are the target's. RoPE comes from the draft's config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specmesh.draft_service.models.common import resolve_draft_base
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import ModelConfig, read_config_json
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.layers import DecoderLayer, KVPair, Rotary, attention_shape

EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")


@dataclass(frozen=True)
class Eagle1Config:
    base: ModelConfig  # the single draft layer's dimensions and RoPE
    fc_bias: bool


def parse_eagle1_config(draft_dir: str | Path) -> Eagle1Config:
    raw = read_config_json(draft_dir)
    base = ModelConfig.from_dict(raw, architectures=EAGLE1_ARCHITECTURES)
    return Eagle1Config(replace(base, num_layers=1), bool(raw.get("bias", False)))


class SharedHead:
    """The target's token embedding and LM head, held by reference (not draft parameters)."""

    def __init__(self, embed_tokens: nn.Embedding, head_weight: torch.Tensor) -> None:
        self.embed_tokens, self.head_weight = embed_tokens, head_weight  # head: [vocab, H]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.to(self.head_weight.dtype) @ self.head_weight.t()).float()  # [rows, vocab]


class Eagle1Draft(nn.Module):
    def __init__(self, cfg: Eagle1Config, shared: SharedHead) -> None:
        super().__init__()
        b = cfg.base
        self.config = cfg
        self.fc = nn.Linear(2 * b.hidden_size, b.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(
            [DecoderLayer(attention_shape(b), b.intermediate_size, input_norm=False)]
        )
        self.rotary = Rotary(b.rope, b.head_dim)
        self._shared = [shared]  # a list, so the target's tensors stay out of the state dict

    @property
    def feature_width(self) -> int:
        """Width of the target features an extend row takes: the final hidden state."""
        return self.config.base.hidden_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0].embed(input_ids)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def forward(
        self,
        positions: torch.Tensor,
        kv_pools: list[KVPair],
        backend: AttentionBackend,
        hidden_in: torch.Tensor,  # [num_tokens, H]: target final hidden (extend) or draft y
        input_ids: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,  # [num_tokens, H], rotated target mm embeds
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.fc.weight.dtype
        embeds = self.embed(input_ids) if input_embeds is None else input_embeds
        u = self.fc(torch.cat([embeds.to(dtype), hidden_in.to(dtype)], dim=-1))  # [n, H]
        y = self.layers[0](u, positions, self.rotary, kv_pools[0], backend)
        return y, self._shared[0].logits(y)


def load_eagle1(
    draft_dir: str | Path, shared: SharedHead, *, dtype: torch.dtype | None = None
) -> Eagle1Draft:
    cfg = parse_eagle1_config(draft_dir)
    width = shared.embed_tokens.weight.shape[1]
    cfg = replace(cfg, base=resolve_draft_base(draft_dir, cfg.base, dtype, width))
    model = Eagle1Draft(cfg, shared).to(cfg.base.dtype)
    model.rotary = Rotary(cfg.base.rope, cfg.base.head_dim)  # inv_freq stays fp32
    tensors = {k.removeprefix("model."): v for k, v in load_tensors(draft_dir).items()}
    tensors.pop("embed_tokens.weight", None)
    assign_parameters(model, tensors, what=str(draft_dir))
    return model.requires_grad_(False).eval()
