"""A DeepSeek-V3-shaped slice with random weights and one NextN (MTP) layer, for measuring
multi-head latent attention and the mixture of experts at V3's widths without its checkpoint:

    python -m specmesh.bench.synthetic_deepseek OUT [--layers 3] [--experts 256] [--device cuda]

writes ``OUT`` (``DeepseekV3ForCausalLM``, bf16, sharded safetensors, the NextN layer as
``model.layers.{layers}.*``; the MTP draft loads from the same folder). V3's widths: hidden
7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, vocabulary 129,280; the first layer dense
(intermediate 18,432), the others MoE with 256 experts of 2,048, top-8 of 8 groups (4 kept), one
shared expert. ``--experts`` fewer keeps every width and a token's top-8 (the bytes a decode
step reads at batch 1) and shrinks the checkpoint: 256 experts are 22.5 GB a MoE layer, so 3
layers with the NextN layer need about 72 GB of disk. Weights are random (normal, std 0.02;
norms 1; the routing bias uniform in +-0.5): the timings are V3's, the acceptance is chance.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from specmesh.bench.synthetic import _save_sharded

V3 = {  # config.json of deepseek-ai/DeepSeek-V3, the layers and experts aside
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


def make_v3_slice(out: Path, device: str = "cpu", seed: int = 0, **overrides: object) -> Path:
    """Write the slice (see the module docstring) into ``out``; ``overrides`` replace entries
    of `V3` (``num_hidden_layers``, ``n_routed_experts``, or every width for a test)."""
    import transformers

    from specmesh.defaults import default_models
    from specmesh.runtime.config import load_model_config

    dims = {**V3, **overrides}
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.DeepseekV3Config(**dims, num_nextn_predict_layers=1, bos_token_id=0,
                                           eos_token_id=1, pad_token_id=2,
                                           tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(out)
    tokenizer_dir = Path(default_models().target)  # any tokenizer: the prompts are ids
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    cfg = load_model_config(out)
    gen = torch.Generator(device).manual_seed(seed)
    _save_sharded(out, _tensors(cfg, gen, device))
    return out


def _tensors(cfg, gen: torch.Generator, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint in its name, drawn one at a time on ``device``."""
    from specmesh.runtime.models.deepseek import DeepseekDecoderLayer

    h, v = cfg.hidden_size, cfg.vocab_size
    yield "model.embed_tokens.weight", _draw(gen, device, "weight", (v, h))
    for i in range(cfg.num_layers + 1):  # the last: the NextN layer
        with torch.device("meta"):
            block = DeepseekDecoderLayer(cfg, i).state_dict()
        for name, t in block.items():
            yield f"model.layers.{i}.{name}", _draw(gen, device, name, tuple(t.shape))
    n = cfg.num_layers
    nextn = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
             "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
             "embed_tokens.weight": (v, h)}  # fmt: skip
    for name, shape in nextn.items():
        yield f"model.layers.{n}.{name}", _draw(gen, device, name, shape)
    yield "model.norm.weight", _draw(gen, device, "norm.weight", (h,))
    yield "lm_head.weight", _draw(gen, device, "weight", (v, h))


def _draw(gen: torch.Generator, device: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):  # fp32 in V3's checkpoints
        return torch.rand(shape, generator=gen, device=device) - 0.5
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.synthetic_deepseek",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=3, help="main layers (the first dense)")
    p.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    make_v3_slice(args.out, args.device, num_hidden_layers=args.layers,
                  n_routed_experts=args.experts)  # fmt: skip
    print(f"target {args.out} (its NextN layer: the MTP draft)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
