"""Model configuration read from a Hugging Face `config.json`, resolved once into a frozen dataclass."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Multi-head latent attention + MoE targets (`runtime.models.deepseek`); not a Llama block, so
# kept apart from the list above, which MTP drafts build their layers from.
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
CAUSAL_LM_ARCHITECTURES = (*SUPPORTED_ARCHITECTURES, *MLA_ARCHITECTURES)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names what is wrong."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def require(cfg: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if cfg.get(key) is None:
            raise CheckpointError(f"config.json lacks required field {key!r}")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default", "linear", "llama3" or "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (`runtime.models.yarn`): ramp bounds, and the magnitude scales of cos / sin and of
    # DeepSeek's softmax (``mscale_all_dim``); None where the config leaves them out.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        """Read both the transformers-4 (`rope_theta` + `rope_scaling`) and -5 (`rope_parameters`)
        spellings."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise CheckpointError(f"unsupported rope scaling type {kind!r}")
        if kind == "yarn":  # transformers' defaults: the context the factor stretches to
            max_position = cfg.get("max_position_embeddings", 8192)
            params.setdefault("original_max_position_embeddings", max_position)
            if params.get("factor") is None:
                params["factor"] = max_position / params["original_max_position_embeddings"]
        optional = {k: None if params.get(k) is None else float(params[k])
                    for k in ("mscale", "mscale_all_dim", "attention_factor")}  # fmt: skip
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            **optional,
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a LoRA (``q_lora_rank``, or
    one ``q_proj`` when None), keys and values from one latent of ``kv_lora_rank`` per token plus
    a shared rope key of ``qk_rope_head_dim`` (`runtime.models.mla`)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims come in (even, odd) pairs
    attention_bias: bool

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> MLAConfig:
        require(cfg, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        q_lora = cfg.get("q_lora_rank")
        return MLAConfig(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek mixture of experts (`runtime.models.moe`): layers from ``first_k_dense_replace``
    on route each token to ``num_experts_per_tok`` of ``n_routed_experts`` beside shared
    experts; V3 by sigmoid scores with noaux_tc grouped top-k (``scoring`` "sigmoid"), V2 by
    softmax scores, top-k over all experts ("greedy") or the best groups
    ("group_limited_greedy")."""

    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int

    @staticmethod
    def from_hf(cfg: dict[str, Any], v2: bool = False) -> MoEConfig:
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {cfg['hidden_act']!r}; expected silu")
        scoring, methods = ("softmax", ("greedy", "group_limited_greedy")) if v2 else (
            "sigmoid", ("noaux_tc",))  # fmt: skip
        if (cfg.get("scoring_func") or scoring) != scoring:
            raise CheckpointError(
                f"unsupported scoring_func {cfg['scoring_func']!r}; expected {scoring!r}"
            )
        method = cfg.get("topk_method") or methods[0]
        if method not in methods:
            raise CheckpointError(f"unsupported topk_method {method!r}; expected one of {methods}")
        require(cfg, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        moe = MoEConfig(
            scoring=scoring,
            topk_method=method,
            n_routed_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", not v2)),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        )
        if moe.n_routed_experts % moe.n_group or moe.topk_group > moe.n_group:
            raise CheckpointError(
                f"{moe.n_routed_experts} experts in {moe.n_group} groups, top {moe.topk_group} "
                "groups: the groups must split the experts evenly and number at least topk_group"
            )
        return moe


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    # What one layer's KV cache holds per token: num_kv_heads x head_dim. With MLA that is one
    # "head" of kv_lora_rank + qk_rope_head_dim (the latent and the rope key; see `mla`).
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mla: MLAConfig | None = None  # DeepSeek-V3: multi-head latent attention
    moe: MoEConfig | None = None  # DeepSeek-V3: mixture of experts
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the whole head, or MLA's decoupled rope part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int | None:
        """MLA: V is the first ``kv_lora_rank`` columns of the cached K (the latent); else None."""
        return None if self.mla is None else self.mla.kv_lora_rank

    @staticmethod
    def from_dict(
        cfg: dict[str, Any], *, architectures: tuple[str, ...] = CAUSAL_LM_ARCHITECTURES
    ) -> ModelConfig:
        arch = (cfg.get("architectures") or ["<missing>"])[0]
        if arch not in architectures:
            raise CheckpointError(
                f"unsupported architecture {arch!r}; supported: {', '.join(architectures)}"
            )
        require(cfg, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mla = MLAConfig.from_hf(cfg) if arch in MLA_ARCHITECTURES else None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=1 if mla else int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=(
                mla.kv_lora_rank + mla.qk_rope_head_dim
                if mla
                else int(cfg.get("head_dim") or hidden // num_heads)
            ),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            mla=mla,
            moe=MoEConfig.from_hf(cfg, v2=arch == "DeepseekV2ForCausalLM") if mla else None,
            extra=cfg,
        )


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def load_model_config(model_dir: str | Path) -> ModelConfig:
    cfg = read_config_json(model_dir)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file() and cfg.get("eos_token_id") is None:
        cfg["eos_token_id"] = json.loads(gen.read_text()).get("eos_token_id")
    return ModelConfig.from_dict(cfg)


def resolve_max_context(requested: int | None, max_position: int, what: str) -> int:
    """Tokens per request: the model's ``max_position_embeddings`` unless ``requested`` says
    otherwise; a larger override is served but warned about (positions past the model's were
    never trained)."""
    if requested is None:
        return max_position
    if requested > max_position:
        logging.getLogger(__name__).warning(
            "%s: max_context %d exceeds the model's max_position_embeddings %d; "
            "positions past it were never trained",
            what,
            requested,
            max_position,
        )
    return requested
