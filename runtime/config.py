"""Model configuration read from a Hugging Face `config.json`, resolved once into a frozen dataclass."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

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


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        """Read both the transformers-4 (`rope_theta` + `rope_scaling`) and -5 (`rope_parameters`)
        spellings."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise CheckpointError(f"unsupported rope scaling type {kind!r}")
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def from_dict(
        cfg: dict[str, Any], *, architectures: tuple[str, ...] = SUPPORTED_ARCHITECTURES
    ) -> ModelConfig:
        arch = (cfg.get("architectures") or ["<missing>"])[0]
        if arch not in architectures:
            raise CheckpointError(
                f"unsupported architecture {arch!r}; supported: {', '.join(architectures)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in cfg:
                raise CheckpointError(f"config.json lacks required field {key!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
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
