"""A Llama-3.1-8B-shaped target with random weights and an EAGLE-3 head of matching shape, for
measuring speed at real sizes without downloading a model:

    python -m specmesh.bench.synthetic OUT [--num-layers 32] [--device cuda]

writes ``OUT/target`` (HF Llama checkpoint, bf16, sharded safetensors, llama3 RoPE) and
``OUT/draft`` (EAGLE-3 in the SpecForge format, draft vocabulary 32000).

Acceptance is forced, not learned. Every attention output and MLP down projection is zero, so
the residual stream stays the input token's embedding and the target's next token is a function
of the current token alone; with the LM head equal to the embedding table that function is the
identity (a random vector's dot product with itself dominates), so greedy decoding repeats the
prompt's last token. The draft is built to compute the same thing: ``fc`` passes the first aux
state (= the embedding) through, its own layer adds zero, and its LM head is the target's rows
for its vocabulary. Every draft token is then accepted: a speculative round emits
``num_steps + 1`` tokens. The matrix products and attention still run at full size on real
(random) operands, so their cost is that of the real model; only the acceptance is ideal.
The prompt's last token must be in the draft vocabulary (ids below 32000).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# Llama-3.1-8B's shapes (config.json of meta-llama/Llama-3.1-8B).
LLAMA_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
DRAFT_VOCAB = 32000  # SpecForge's EAGLE-3 heads for Llama-3.1-8B
SHARD_BYTES = 4 << 30


def make_synthetic_pair(
    out: Path, tokenizer_dir: Path, device: str = "cpu", seed: int = 0, **overrides: object
) -> tuple[Path, Path]:
    """Write the target and its draft (see the module docstring); returns their directories.
    ``overrides`` replace entries of LLAMA_8B (``num_hidden_layers=2`` for a quick check)."""
    import transformers

    dims = {**LLAMA_8B, **overrides}
    gen = torch.Generator(device).manual_seed(seed)
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    # The logit gap between the current token and any other is about hidden_size * std (a
    # vector's dot product with itself over its RMS): keep it above 64 at any width.
    h = dims["hidden_size"]
    embed = _rand(gen, device, dims["vocab_size"], h, std=max(0.02, 64 / h))
    _save_sharded(target, _target_tensors(dims, embed, gen, device))
    cfg = transformers.LlamaConfig(**dims, architectures=["LlamaForCausalLM"], bos_token_id=0,
                                   eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                                   dtype="bfloat16")  # fmt: skip
    cfg.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    draft = out / "draft"
    _write_draft(draft, dims, embed, gen, device)
    return target, draft


def _rand(gen: torch.Generator, device: str, *shape: int, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)


def _target_tensors(dims: dict, embed: torch.Tensor, gen: torch.Generator, device: str):
    h, inter = dims["hidden_size"], dims["intermediate_size"]
    head_dim = h // dims["num_attention_heads"]
    kv = dims["num_key_value_heads"] * head_dim
    zeros = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device=device)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device=device)
    yield "model.embed_tokens.weight", embed
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", _rand(gen, device, h, h)
        yield p + "self_attn.k_proj.weight", _rand(gen, device, kv, h)
        yield p + "self_attn.v_proj.weight", _rand(gen, device, kv, h)
        yield p + "self_attn.o_proj.weight", zeros(h, h)
        yield p + "mlp.gate_proj.weight", _rand(gen, device, inter, h)
        yield p + "mlp.up_proj.weight", _rand(gen, device, inter, h)
        yield p + "mlp.down_proj.weight", zeros(h, inter)
        yield p + "input_layernorm.weight", ones(h)
        yield p + "post_attention_layernorm.weight", ones(h)
    yield "model.norm.weight", ones(h)
    yield "lm_head.weight", embed.clone()


def _save_sharded(out: Path, tensors) -> None:
    """safetensors shards of at most SHARD_BYTES and their index (the HF layout)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        if size and size + t.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += t.nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_draft(
    out: Path, dims: dict, embed: torch.Tensor, gen: torch.Generator, device: str
) -> None:
    from safetensors.torch import save_file

    from specmesh.runtime.tiny import eagle3_config

    h, inter, n = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    head_dim = h // dims["num_attention_heads"]
    heads, kv = dims["num_attention_heads"], dims["num_key_value_heads"]
    aux_ids = [1, n // 2 - 1, n - 4] if n >= 8 else [0, n // 2, n - 1]
    draft_vocab = min(DRAFT_VOCAB, dims["vocab_size"])
    fc = torch.zeros(h, len(aux_ids) * h, dtype=torch.bfloat16, device=device)
    fc[:, :h] = torch.eye(h, dtype=torch.bfloat16, device=device)  # the first aux state, as is
    zeros = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device=device)
    ones = lambda: torch.ones(h, dtype=torch.bfloat16, device=device)
    tensors = {
        "fc.weight": fc,
        "midlayer.self_attn.q_proj.weight": _rand(gen, device, heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": _rand(gen, device, kv * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": _rand(gen, device, kv * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": zeros(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": _rand(gen, device, inter, h),
        "midlayer.mlp.up_proj.weight": _rand(gen, device, inter, h),
        "midlayer.mlp.down_proj.weight": zeros(h, inter),
        "midlayer.input_layernorm.weight": ones(),
        "midlayer.hidden_norm.weight": ones(),
        "midlayer.post_attention_layernorm.weight": ones(),
        "norm.weight": ones(),
        "lm_head.weight": embed[:draft_vocab].clone(),  # draft id i is target id i
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(dims["vocab_size"]) < draft_vocab,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    sizes = {"hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": dims["vocab_size"],
             "max_position_embeddings": dims["max_position_embeddings"]}  # fmt: skip
    config = eagle3_config(sizes, aux_ids, draft_vocab, dims["rope_theta"], "bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    from specmesh.defaults import default_models

    p = argparse.ArgumentParser(prog="python -m specmesh.bench.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("out", type=Path)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    tokenizer_dir = Path(default_models().target)
    target, draft = make_synthetic_pair(
        args.out, tokenizer_dir, args.device, num_hidden_layers=args.num_layers
    )
    print(f"target {target}\ndraft {draft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
