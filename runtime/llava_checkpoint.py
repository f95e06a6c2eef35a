"""A LLaVA checkpoint (`LlavaForConditionalGeneration`, llava-hf layout) read as a language model:
its text config and the tensors of its language model, under either naming transformers has
written. The vision side is the target's (`specmesh.target_service.llava`); drafts and the tiny
checkpoint writers need only this.

    language model   model.language_model.*  |  language_model.model.*   ->  model.*
    LM head          lm_head.weight          |  language_model.lm_head.weight
    vision tower     model.vision_tower.*    |  vision_tower.*  (optionally + vision_model.*)
    projector        model.multi_modal_projector.*  |  multi_modal_projector.*
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specmesh.runtime.config import (
    CheckpointError,
    ModelConfig,
    load_model_config,
    read_config_json,
)
from specmesh.runtime.loader import load_tensors

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",  # MLA + MoE (`runtime.models.deepseek`)
}
_PREFIXES = {  # checkpoint prefix → (part, prefix inside the part)
    "model.language_model.": ("lm", "model."),
    "language_model.model.": ("lm", "model."),
    "language_model.lm_head.": ("lm", "lm_head."),
    "lm_head.": ("lm", "lm_head."),
    "model.vision_tower.": ("vision", ""),
    "vision_tower.": ("vision", ""),
    "model.multi_modal_projector.": ("projector", ""),
    "multi_modal_projector.": ("projector", ""),
}


def is_llava_checkpoint(model_dir: str | Path) -> bool:
    raw = read_config_json(model_dir)
    return (raw.get("architectures") or [""])[0] in LLAVA_ARCHITECTURES


def split_llava_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a LLaVA checkpoint's tensors into ``lm`` (CausalLM names), ``vision``, ``projector``."""
    parts: dict[str, dict[str, torch.Tensor]] = {"lm": {}, "vision": {}, "projector": {}}
    for name, t in tensors.items():
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            raise CheckpointError(f"LLaVA checkpoint has an unexpected tensor {name!r}")
        part, inner = _PREFIXES[prefix]
        parts[part][inner + name[len(prefix) :]] = t
    return parts


def language_model_tensors(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` (CausalLM names, e.g. ``model.embed_tokens.weight``) from a plain or a LLaVA
    checkpoint, loading only those tensors: what an out-of-process draft needs of its target."""
    if not is_llava_checkpoint(model_dir):
        return load_tensors(model_dir, names)
    candidates = {  # checkpoint name → CausalLM name
        prefix + name[len(inner) :]: name
        for name in names
        for prefix, (part, inner) in _PREFIXES.items()
        if part == "lm" and name.startswith(inner)
    }
    return {candidates[k]: t for k, t in load_tensors(model_dir, candidates).items()}


def target_model_config(model_dir: str | Path) -> ModelConfig:
    """The (language) model config of a plain or a LLaVA target checkpoint."""
    if not is_llava_checkpoint(model_dir):
        return load_model_config(model_dir)
    return text_model_config(read_config_json(model_dir), model_dir)


def text_model_config(raw: dict[str, Any], model_dir: str | Path) -> ModelConfig:
    """The language model's `ModelConfig` from a LLaVA ``config.json`` (``text_config`` plus the
    top-level dtype / token ids / tying it inherits)."""
    text = dict(raw.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind not in _TEXT_ARCHITECTURES:
        raise CheckpointError(
            f"{model_dir}: LLaVA text model type {kind!r} is not supported; "
            f"supported: {', '.join(_TEXT_ARCHITECTURES)}"
        )
    text["architectures"] = [_TEXT_ARCHITECTURES[kind]]
    for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    gen = Path(model_dir) / "generation_config.json"
    if text.get("eos_token_id") is None and gen.is_file():
        text["eos_token_id"] = json.loads(gen.read_text()).get("eos_token_id")
    return ModelConfig.from_dict(text)
