"""Multi-layer EAGLE / DeepSeek-style MTP draft network: ``L`` next-token layers, one per step.

Layer i (DeepSeek-V3 "nextn" layer):

    u  = eh_proj(cat(enorm(embed(x)), hnorm(h)))      2H -> H, embedding first, no bias
    h' = block(u)                                      a decoder layer (input norm included)
    logits = target_lm_head(shared_head.norm(h'))      the target's head; h' feeds the next layer

Layer 0 takes the target's hidden state BEFORE its final norm; layer i takes layer i-1's h'.

Checkpoint layout (DeepSeek-V3's, where the MTP module is stored after the main stack):
``config.json`` holds the target's dimensions, ``num_hidden_layers = N`` (the target's layer count)
and ``num_nextn_predict_layers = L``; layer i's tensors are named ``model.layers.{N+i}.``:

    enorm.weight [H]   hnorm.weight [H]   eh_proj.weight [H, 2H]   shared_head.norm.weight [H]
    input_layernorm.weight, self_attn.*, post_attention_layernorm.weight, mlp.*   (the block)

The block follows the architecture: a Llama / Qwen block (``LlamaForCausalLMMTP`` and the Llama
family), or for ``DeepseekV3ForCausalLM`` (``--draft-model`` = the DeepSeek checkpoint itself)
DeepSeek's own layer ``N + i``: multi-head latent attention over a latent KV pool, and MoE or a
dense MLP as ``first_k_dense_replace`` says for that index. SGLang's export of those layers
(``DeepseekV3ForCausalLMNextN``, stored as ``model.layers.{i}``) loads too. Only the NextN
layers' tensors are read. ``embed_tokens.weight`` and ``shared_head.head.weight`` copies, if present, are not read:
the target's embedding and head are used (DeepSeek-V3 ships copies of them; SGLang does the same).
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
    CAUSAL_LM_ARCHITECTURES,
    CheckpointError,
    ModelConfig,
    read_config_json,
)
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.deepseek import DeepseekDecoderLayer, routing_bias_to_fp32
from specmesh.runtime.models.layers import DecoderLayer, KVPair, RMSNorm, Rotary, attention_shape

MTP_ARCHITECTURES = ("LlamaForCausalLMMTP", *CAUSAL_LM_ARCHITECTURES)


# SGLang's exported NextN checkpoint (`scripts/export_deepseek_nextn.py`): the DeepSeek config
# renamed, the NextN layers moved to model.layers.0.., embed_tokens / shared_head.head dropped.
NEXTN_EXPORT = "DeepseekV3ForCausalLMNextN"


@dataclass(frozen=True)
class MTPConfig:
    base: ModelConfig  # one MTP layer's dimensions and RoPE
    first_layer: int  # N: layer i is stored as model.layers.{N + i}
    num_layers: int  # L = num_nextn_predict_layers
    # Index of layer 0's block in the full model, which picks DeepSeek's dense MLP or MoE:
    # N in the checkpoint itself; for an export (stored at 0) a MoE index, as SGLang builds it.
    block_index: int


def parse_mtp_config(draft_dir: str | Path) -> MTPConfig:
    raw = read_config_json(draft_dir)
    exported = (raw.get("architectures") or [None])[0] == NEXTN_EXPORT
    if exported:
        raw = {**raw, "architectures": ["DeepseekV3ForCausalLM"]}
    base = ModelConfig.from_dict(raw, architectures=MTP_ARCHITECTURES)
    num = int(raw.get("num_nextn_predict_layers") or 0)
    if num < 1:
        raise CheckpointError(f"{draft_dir}: config.json needs num_nextn_predict_layers >= 1")
    if not exported:
        return MTPConfig(replace(base, num_layers=num), base.num_layers, num, base.num_layers)
    moe_index = 0 if base.moe is None else base.moe.first_k_dense_replace
    return MTPConfig(replace(base, num_layers=num), 0, num, moe_index)


class _SharedHeadNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


def _add_nextn_parts(layer: nn.Module, cfg: ModelConfig) -> None:
    """The MTP input projection and the pre-head norm, beside a block's own modules."""
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer.enorm = RMSNorm(h, eps)
    layer.hnorm = RMSNorm(h, eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = _SharedHeadNorm(h, eps)


class MTPLayer(DecoderLayer):
    """A Llama decoder block plus the MTP input projection and the pre-head norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(attention_shape(cfg), cfg.intermediate_size)
        _add_nextn_parts(self, cfg)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3's NextN layer ``index``: MLA, MoE or dense, plus the MTP parts."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        _add_nextn_parts(self, cfg)


def mtp_layer(cfg: ModelConfig, index: int) -> nn.Module:
    """A NextN layer for the config's block; ``index``: its block's index in the full model."""
    return MTPLayer(cfg) if cfg.mla is None else DeepseekMTPLayer(cfg, index)


class MTPDraft(nn.Module):
    def __init__(self, cfg: MTPConfig, shared: SharedHead) -> None:
        super().__init__()
        self.config = cfg
        index = range(cfg.block_index, cfg.block_index + cfg.num_layers)
        self.layers = nn.ModuleList(mtp_layer(cfg.base, i) for i in index)
        self.rotary = Rotary(cfg.base.rope, cfg.base.rope_dim)
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
    model.rotary = Rotary(cfg.base.rope, cfg.base.rope_dim)  # inv_freq stays fp32
    routing_bias_to_fp32(model)
    assign_parameters(model, _nextn_tensors(draft_dir, cfg, model), what=str(draft_dir))
    return model.requires_grad_(False).eval()


def _nextn_tensors(draft_dir: str | Path, cfg: MTPConfig, model: MTPDraft) -> dict:
    """The NextN layers' tensors only (``draft_dir`` may be the whole target checkpoint), named
    as ``model``'s: ``model.layers.{N+i}.x`` (or ``layers.{N+i}.x``) -> ``layers.{i}.x``."""
    own: dict[str, str] = {}
    for name in model.state_dict():
        _, i, rest = name.split(".", 2)
        stored = f"layers.{cfg.first_layer + int(i)}.{rest}"
        own[stored] = own[f"model.{stored}"] = name
    found = {own[k]: t for k, t in load_tensors(draft_dir, own).items()}
    missing = [i for i in range(cfg.num_layers) if f"layers.{i}.eh_proj.weight" not in found]
    if missing:
        first = cfg.first_layer + missing[0]
        raise CheckpointError(
            f"{draft_dir}: no NextN layer model.layers.{first}.* (config.json says "
            f"num_nextn_predict_layers={cfg.num_layers} after {cfg.first_layer} layers): this "
            "checkpoint has no MTP weights; export them or choose another --draft-kind"
        )
    return found
