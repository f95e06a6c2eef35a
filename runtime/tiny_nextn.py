"""A DeepSeek-V3 NextN (MTP) layer appended to a tiny checkpoint, in the published layout.

DeepSeek-V3 stores its multi-token-prediction module after the main stack, as layer
``N = num_hidden_layers`` (``num_nextn_predict_layers`` layers in all):

    model.layers.{N}.enorm.weight               [H]       normalizes the next token's embedding
    model.layers.{N}.hnorm.weight               [H]       normalizes the main model's hidden state
    model.layers.{N}.eh_proj.weight             [H, 2H]   over cat(enorm(e), hnorm(h))
    model.layers.{N}.input_layernorm.weight, self_attn.* (MLA), post_attention_layernorm.weight,
    model.layers.{N}.mlp.*                      MoE (or dense below first_k_dense_replace)
    model.layers.{N}.shared_head.norm.weight    [H]
    model.layers.{N}.shared_head.head.weight    [V, H]    a copy of lm_head
    model.layers.{N}.embed_tokens.weight        [V, H]    a copy of model.embed_tokens

transformers neither builds nor saves this layer, so the tensors are written into
``model.safetensors`` here: random at the checkpoint's scale (matrices ``N(0, std)``, norms 1, the
routing bias uniform like `make_tiny_deepseek`'s), or, with ``copy_layer``, a NextN layer that
predicts well (see `add_nextn_layer`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specmesh.runtime.config import ModelConfig, load_model_config


def add_nextn_layer(
    model_dir: str | Path,
    *,
    seed: int = 1,
    std: float = 0.3,
    copy_layer: int | None = None,
) -> Path:
    """Write layer ``num_hidden_layers`` (one NextN layer) into ``model_dir``'s single-file
    checkpoint and set ``num_nextn_predict_layers: 1``.

    ``copy_layer``: the block is a copy of that main layer (it must be dense or MoE like the
    NextN index) and ``eh_proj`` passes the embedding through, ``u = enorm(e)`` with ``enorm``
    scaled to the embeddings' RMS: on a one-layer target the NextN layer then recomputes the
    target on the context shifted by one token (all but the first token), so its guesses are
    mostly the target's next token. A test trick, not a trained layer: losslessness never
    depends on it, only how much speculation gets accepted."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    n, h = cfg.num_layers, cfg.hidden_size
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a mapping
    g = torch.Generator().manual_seed(seed)
    embed = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embed)
    if copy_layer is None:
        block = _random_block(cfg, g, std)
        enorm = torch.ones(h)
        eh_proj = torch.randn(h, 2 * h, generator=g) * std
    else:
        src = f"model.layers.{copy_layer}."
        block = {k.removeprefix(src): v.clone() for k, v in tensors.items() if k.startswith(src)}
        enorm = embed.pow(2).mean(-1).sqrt().mean().expand(h).clone()  # u ~ e in scale
        eh_proj = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    nextn = {
        **block,
        "enorm.weight": enorm,
        "hnorm.weight": torch.ones(h),
        "eh_proj.weight": eh_proj,
        "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        "shared_head.head.weight": head.clone(),
        "embed_tokens.weight": embed.clone(),
    }
    tensors.update({f"model.layers.{n}.{k}": v.to(embed.dtype) for k, v in nextn.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def _random_block(cfg: ModelConfig, g: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """Layer ``num_layers``' decoder block (MLA + MoE or dense) in the checkpoint's names."""
    from specmesh.runtime.models.deepseek import DeepseekDecoderLayer

    block = DeepseekDecoderLayer(cfg, cfg.num_layers)
    out = {}
    for name, t in block.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            out[name] = torch.rand(t.shape, generator=g) - 0.5
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(t.shape)
        else:
            out[name] = torch.randn(t.shape, generator=g) * std
    return out


def export_nextn(model_dir: str | Path, out_dir: str | Path) -> Path:
    """SGLang's ``export_deepseek_nextn.py`` layout of ``model_dir``'s NextN layer: config with
    ``architectures: [DeepseekV3ForCausalLMNextN]`` and ``num_hidden_layers: 1``, the layer's
    tensors renamed to ``model.layers.0.*`` without ``embed_tokens`` / ``shared_head.head``
    (the target's are used)."""
    model_dir, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        tensors = {
            "model.layers.0." + k.removeprefix(prefix): f.get_tensor(k)
            for k in f.keys()  # noqa: SIM118 - not a mapping
            if k.startswith(prefix) and "embed_tokens" not in k and "shared_head.head" not in k
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(architectures=["DeepseekV3ForCausalLMNextN"], num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
