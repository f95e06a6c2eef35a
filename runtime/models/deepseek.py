"""DeepSeek-V3-class targets (``DeepseekV3ForCausalLM``): the Llama stack's interface (positions,
KV pools, backend, ids or embeddings in; `ModelOutput` with EAGLE-3 aux captures out, all from
`CausalLM`), with each layer's attention multi-head latent attention (`mla`) over a latent
cache and its MLP dense for the first ``first_k_dense_replace`` layers, a mixture of experts
(`moe`) after.

The checkpoint's NextN (MTP) layers (``model.layers.{num_hidden_layers}...``) are not part of
the target (its loader reads only the stack's tensors): the ``mtp`` draft kind builds them from
`DeepseekDecoderLayer` (`specmesh.draft_service.models.mtp`).

Tensor parallelism shards the query heads and every expert's intermediate size
(`runtime.parallel`); FlashInfer's MLA kernels are not wired in yet.
"""

from __future__ import annotations

import torch
from torch import nn

from specmesh.protocol.features import AuxLayers
from specmesh.runtime.config import ModelConfig
from specmesh.runtime.models.causal_lm import CausalLM
from specmesh.runtime.models.layers import MLP, PreNormBlock, RMSNorm
from specmesh.runtime.models.mla import MLAttention
from specmesh.runtime.models.moe import MoE, MoEGate
from specmesh.runtime.parallel import SINGLE, TensorParallel


class DeepseekDecoderLayer(PreNormBlock):
    """Pre-norm block: MLA, then a dense SwiGLU MLP or the MoE."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        dense = moe is None or index < moe.first_k_dense_replace
        self.mlp = MLP(h, cfg.intermediate_size, tp) if dense else MoE(h, moe, tp)


class DeepseekV3CausalLM(CausalLM):
    def __init__(
        self, cfg: ModelConfig, aux: AuxLayers | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: the config has no multi-head latent attention")
        super().__init__(cfg, aux, tp)

    def decoder_layer(self, index: int) -> nn.Module:
        return DeepseekDecoderLayer(self.config, index, self.tp)

    def reset_fp32_buffers(self, device: str | torch.device) -> None:
        """The rotary frequencies, and the routing bias (fp32 in transformers too, whatever the
        model's dtype: it decides which experts run)."""
        super().reset_fp32_buffers(device)
        routing_bias_to_fp32(self)


def routing_bias_to_fp32(module: nn.Module) -> None:
    """Every MoE gate's ``e_score_correction_bias`` back to fp32 after a cast of ``module``."""
    for gate in module.modules():
        if isinstance(gate, MoEGate) and gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias = gate.e_score_correction_bias.float()
