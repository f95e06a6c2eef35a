"""Llama-family decoder-only LM: Llama (incl. llama3 / linear / YaRN RoPE scaling), Qwen2 (qkv
bias), Qwen3 (q/k RMSNorm). One class: the three differ only by flags in `ModelConfig`. Other
blocks subclass it and override `decoder_layer` (DeepSeek-V3: `runtime.models.deepseek`).

With a `TensorParallel` of world size N > 1 the model is one rank's shard (`runtime.parallel`):
every rank runs the same forward on its shard and the all-reduces keep the residual stream
replicated; `compute_logits` gathers the vocabulary-parallel logits once. World size 1 is the
plain model, unchanged."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specmesh.protocol.features import AuxLayers
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import CheckpointError, ModelConfig, load_model_config
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    KVPair,
    RMSNorm,
    Rotary,
    VocabParallelEmbedding,
    attention_shape,
)
from specmesh.runtime.parallel import SINGLE, TensorParallel, vocab_range
from specmesh.runtime.shard_loader import load_shard_tensors


@dataclass
class ModelOutput:
    """What one forward returns, per flat token row. Slicing every field is one call (invariant 2)."""

    hidden: torch.Tensor  # [num_tokens, hidden], after the final norm (the LM head's input)
    hidden_pre_norm: torch.Tensor  # [num_tokens, hidden], before the final norm (MTP chaining)
    aux_hidden: torch.Tensor | None = None  # [num_tokens, n_aux * hidden], EAGLE-3 captures
    mm_input_embeds: torch.Tensor | None = None  # [num_tokens, hidden], multimodal prefill only
    # Set by a graph runner that runs the LM head in its graph (`CausalLM.head_outputs`):
    logits: torch.Tensor | None = None  # [num_tokens, vocab] fp32
    greedy: torch.Tensor | None = None  # [num_tokens] int64, each row's argmax

    def select(self, index: torch.Tensor | slice) -> ModelOutput:
        """Apply one row selection to every tensor field, so no field can be forgotten."""
        fields = {
            k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()
        }
        return ModelOutput(**fields)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
            if tp.enabled
            else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, aux: AuxLayers | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = _Backbone(cfg, tp, [self.decoder_layer(i) for i in range(cfg.num_layers)])
        self.rotary = Rotary(cfg.rope, cfg.rope_dim)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            head_rows = vocab_range(cfg.vocab_size, tp)[1]
            self.lm_head = nn.Linear(cfg.hidden_size, head_rows, bias=False)
        self.set_aux_layers(aux)
        self.fused = False  # `fuse_kernels`

    def fuse_kernels(self) -> None:
        """Run the decoder on the fused CUDA kernels (`kernels.fused`): RMSNorm with the residual
        add, RoPE with the KV store, SiLU * up, and merged q/k/v and gate/up products."""
        if not (self.head_weight.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("fused kernels run on CUDA (or on CPU under TRITON_INTERPRET=1)")
        full_rotary = self.config.rope_dim == self.config.head_dim  # what rope_store rotates
        for module in self.modules():
            if isinstance(module, MLP) or (isinstance(module, Attention) and full_rotary):
                module.fuse()
        self.fused = True

    def decoder_layer(self, index: int) -> nn.Module:
        """Layer ``index`` of the stack, called as ``layer(h, positions, rotary, kv, backend)``."""
        return DecoderLayer(attention_shape(self.config), self.config.intermediate_size, tp=self.tp)

    def reset_fp32_buffers(self, device: str | torch.device) -> None:
        """Rebuild what stays fp32 whatever the model's dtype (after ``to_empty`` / ``to``):
        the rotary frequencies."""
        self.rotary.inv_freq = Rotary(self.config.rope, self.config.rope_dim).inv_freq.to(device)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them at world size 1)."""
        return self.model.layers[0].self_attn.num_kv_heads if self.model.layers else 0

    def set_aux_layers(self, aux: AuxLayers | None) -> None:
        self.aux_points = aux.capture_points(self.config.num_layers) if aux else ()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def head_outputs(self, out: ModelOutput, greedy: bool = False) -> ModelOutput:
        """``out`` with its rows' logits (and with ``greedy`` their argmax): what a target's
        graph runner captures after the forward, so neither is a launch of its own."""
        out.logits = self.compute_logits(out.hidden)
        if greedy:
            out.greedy = out.logits.argmax(-1)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.head_weight.t()  # [rows, vocab], or [rows, this rank's rows]
        if self.tp.world_size > 1:
            logits = self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        return logits.float()  # [rows, vocab] fp32

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        kv_pools: list[KVPair],
        backend: AttentionBackend,
        input_ids: torch.Tensor | None = None,  # [num_tokens]
        input_embeds: torch.Tensor | None = None,  # [num_tokens, hidden], e.g. merged image embeds
    ) -> ModelOutput:
        h = self.embed(input_ids) if input_embeds is None else input_embeds
        captured: dict[int, torch.Tensor] = {}
        if self.fused:
            hidden, h = self._fused_layers(h, positions, kv_pools, backend, captured)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in self.aux_points:
                    captured[i] = h
                h = layer(h, positions, self.rotary, kv_pools[i], backend)
            hidden = self.model.norm(h)
        captured[len(self.model.layers)] = h
        aux = torch.cat([captured[p] for p in self.aux_points], -1) if self.aux_points else None
        mm = input_embeds if input_embeds is not None and input_ids is None else None
        return ModelOutput(hidden, h, aux, mm)

    def _fused_layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_pools: list[KVPair],
        backend: AttentionBackend, captured: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The layers with each residual add fused into the next RMSNorm: (normed, pre-norm)."""
        from specmesh.kernels.fused import add_rms_norm

        delta = None  # the last block's output is h + delta
        for i, layer in enumerate(self.model.layers):
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, norm.weight, norm.eps, delta)
            if i in self.aux_points:
                captured[i] = h
            h, delta = layer.forward_fused(h, x, positions, self.rotary, kv_pools[i], backend)
        h, hidden = add_rms_norm(h, self.model.norm.weight, self.model.norm.eps, delta)
        return hidden, h


def load_causal_lm(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Build the model from ``config.json`` and fill it from safetensors; errors name the tensor.
    With ``tp`` enabled, only this rank's slice of each tensor is read."""
    cfg = load_model_config(model_dir)
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    with torch.device("meta"):
        model = causal_lm_class(cfg)(cfg, tp=tp)
    model = model.to_empty(device=device).to(cfg.dtype)
    model.reset_fp32_buffers(device)
    if tp.enabled:
        tensors = load_shard_tensors(model_dir, model.state_dict(), cfg, tp)
    else:  # the model's own tensors only: e.g. not DeepSeek's NextN layers past the stack
        tensors = load_tensors(model_dir, model.state_dict())
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise CheckpointError(f"{model_dir}: untied checkpoint is missing tensor 'lm_head.weight'")
    assign_parameters(model, tensors, what=str(model_dir))
    return model.requires_grad_(False).eval()


def causal_lm_class(cfg: ModelConfig) -> type[CausalLM]:
    """The model class of ``cfg``'s architecture."""
    if cfg.mla is None:
        return CausalLM
    from specmesh.runtime.models.deepseek import DeepseekV3CausalLM  # imports this module

    return DeepseekV3CausalLM
