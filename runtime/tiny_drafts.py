"""Tiny random drafts for a tiny target (`specmesh.runtime.tiny`), one per draft kind.

    eagle3      SpecForge / SGLang EAGLE-3 (`make_tiny_eagle3`)
    eagle       EAGLE-1/2 (SafeAILab format): fc [H, 2H] + fc.bias, layers.0.* without
                input_layernorm, no norm, no lm_head
    mtp         DeepSeek-style MTP layers model.layers.{N+i}.* (see `draft_service/models/mtp.py`)
    standalone  a 2-layer LlamaForCausalLM with the target's vocab and tokenizer files

Weights are random (scale 0.1, norms 1), written as safetensors with a config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specmesh.runtime.config import ModelConfig, load_model_config

DRAFT_KINDS_WITH_WEIGHTS = ("eagle3", "eagle", "mtp", "standalone")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_tiny_draft(
    out_dir: str | Path, target_dir: str | Path, kind: str, *, seed: int = 0, **options: object
) -> Path:
    """Write a random draft of ``kind`` matching ``target_dir``. ``options``: ``mtp`` takes
    ``num_nextn_predict_layers`` (default 3); ``eagle3`` takes ``draft_vocab_size``."""
    if kind == "eagle3":
        from specmesh.runtime.tiny import make_tiny_eagle3

        return make_tiny_eagle3(out_dir, target_dir, seed=seed, **options)  # type: ignore[arg-type]
    if kind == "eagle":
        return _make_eagle1(Path(out_dir), load_model_config(target_dir), seed)
    if kind == "mtp":
        num = int(options.get("num_nextn_predict_layers", 3))  # type: ignore[call-overload]
        return _make_mtp(Path(out_dir), load_model_config(target_dir), seed, num)
    if kind == "standalone":
        return _make_standalone(Path(out_dir), Path(target_dir), seed)
    raise ValueError(f"no tiny draft for kind {kind!r}; choose from {DRAFT_KINDS_WITH_WEIGHTS}")


def _layer_tensors(t: ModelConfig, rand, prefix: str, *, input_norm: bool) -> dict:
    """A Llama decoder layer's tensors under ``prefix``."""
    h, inter = t.hidden_size, t.intermediate_size
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    out = {
        f"{prefix}self_attn.q_proj.weight": rand(q, h),
        f"{prefix}self_attn.k_proj.weight": rand(kv, h),
        f"{prefix}self_attn.v_proj.weight": rand(kv, h),
        f"{prefix}self_attn.o_proj.weight": rand(h, q),
        f"{prefix}mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}mlp.up_proj.weight": rand(inter, h),
        f"{prefix}mlp.down_proj.weight": rand(h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = torch.ones(h)
    return out


def _base_config(t: ModelConfig, arch: str, num_layers: int) -> dict:
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": t.max_position,
        "rope_theta": 10000.0,
        "vocab_size": t.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _write(out: Path, tensors: dict, config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _rand(seed: int):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g) * 0.1


def _make_eagle1(out: Path, t: ModelConfig, seed: int) -> Path:
    rand, h = _rand(seed), t.hidden_size
    tensors = {
        "fc.weight": rand(h, 2 * h),
        "fc.bias": rand(h),
        **_layer_tensors(t, rand, "layers.0.", input_norm=False),
    }
    return _write(out, tensors, {**_base_config(t, "LlamaForCausalLM", 1), "bias": True})


def _make_mtp(out: Path, t: ModelConfig, seed: int, num_layers: int) -> Path:
    rand, h, n = _rand(seed), t.hidden_size, t.num_layers
    tensors = {}
    for i in range(num_layers):
        p = f"model.layers.{n + i}."
        tensors.update(_layer_tensors(t, rand, p, input_norm=True))
        tensors[f"{p}enorm.weight"] = torch.ones(h)
        tensors[f"{p}hnorm.weight"] = torch.ones(h)
        tensors[f"{p}eh_proj.weight"] = rand(h, 2 * h)
        tensors[f"{p}shared_head.norm.weight"] = torch.ones(h)
    config = {
        **_base_config(t, "LlamaForCausalLMMTP", n),
        "num_nextn_predict_layers": num_layers,
    }
    return _write(out, tensors, config)


def _make_standalone(out: Path, target_dir: Path, seed: int) -> Path:
    from specmesh.runtime.tiny import make_tiny_target

    t = load_model_config(target_dir)
    make_tiny_target(out, seed=seed + 1, vocab_size=t.vocab_size, num_hidden_layers=2)
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    return out
