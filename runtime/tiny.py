"""Tiny random checkpoints with a locally trained tokenizer: no download, seconds on CPU.

Used by `specmesh make-tiny` and the tests. Models are written with `transformers`'
``save_pretrained`` so they are ordinary Hugging Face checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

_CORPUS = """
specmesh serves language models with speculative decoding. A router batches requests and
drives a target service and a draft service over gRPC streams. The draft proposes a tree of
tokens, the target verifies the tree in one forward pass and keeps the accepted path.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:()[]{}<>=+-*/ "'
"""

TINY_DIMS = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a built-in corpus; ids 0..2 are bos / eos / pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def make_tiny_target(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.3,
    **overrides: object,
) -> Path:
    """Write a random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``.

    The default ``initializer_range`` (0.3, not transformers' 0.02) keeps greedy output varied:
    at small scales a random model falls into one repeated token within a few steps, and an
    oracle test whose output repeats one token cannot tell one token's KV from another's."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(classes)}")
    out = Path(out_dir)
    tokenizer = build_tokenizer(int(overrides.get("vocab_size", TINY_DIMS["vocab_size"])))
    config_cls, model_cls = classes[arch]
    dims = {**TINY_DIMS, **overrides}
    config = config_cls(
        **dims,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


TINY_DEEPSEEK_DIMS = {
    "vocab_size": 320,  # the tokenizer's 256 bytes + 3 specials + merges
    "hidden_size": 64,
    "intermediate_size": 96,  # the dense layers'
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 1024,
    # YaRN as DeepSeek-V3 configures it (mscale = mscale_all_dim: cos / sin unscaled, softmax
    # scaled by mscale(4, 1) ** 2), stretching 256 trained positions to 1024.
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 256, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}  # fmt: skip


def make_tiny_deepseek(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.3,
    nextn: bool = False,
    nextn_copies_layer: int | None = None,
    version: int = 3,
    **overrides: object,
) -> Path:
    """Write a random ``DeepseekV3ForCausalLM`` (``version=2``: ``DeepseekV2ForCausalLM``, softmax
    routing; ``topk_method`` as an override) (multi-head latent attention, MoE with a shared
    expert and grouped routing after one dense layer) with the tiny tokenizer. The routing bias
    ``e_score_correction_bias`` is drawn at random too (transformers initializes it to zero),
    so a test sees it steer the choice of experts.

    ``nextn``: also write a random NextN (MTP) layer ``model.layers.{num_hidden_layers}.*``;
    ``nextn_copies_layer``: one that copies that layer's block and predicts well
    (`runtime.tiny_nextn.add_nextn_layer`)."""
    import transformers

    dims = {**TINY_DEEPSEEK_DIMS, **overrides}
    tokenizer = build_tokenizer(int(dims["vocab_size"]))  # type: ignore[call-overload]
    config_cls, model_cls = {
        3: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        2: (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    }[version]
    config = config_cls(
        **dims,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)  # V3's only
            if bias is not None:
                bias.uniform_(-0.5, 0.5)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if nextn or nextn_copies_layer is not None:
        from specmesh.runtime.tiny_nextn import add_nextn_layer

        add_nextn_layer(
            out_dir, seed=seed + 1, std=initializer_range, copy_layer=nextn_copies_layer
        )
    return Path(out_dir)


def make_tiny_eagle3(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
) -> Path:
    """A random EAGLE-3 draft in the SpecForge / SGLang format, matching ``target_dir``.

    ``aux_layer_ids`` go to ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SpecForge's
    "output" numbering (id i = the output of target layer i); default ``[1, L/2 - 1, L - 4]``.
    ``fc`` reads their concatenation, so its input width is ``len(aux_layer_ids) * hidden``.
    """
    import json

    from safetensors.torch import save_file

    from specmesh.runtime.config import load_model_config

    t = load_model_config(target_dir)
    h, vocab, n = t.hidden_size, t.vocab_size, t.num_layers
    aux_ids = list(aux_layer_ids) if aux_layer_ids is not None else [1, n // 2 - 1, n - 4]
    vd = draft_vocab_size or vocab
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    heads, kv_heads, head_dim, inter = t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size
    used = torch.randperm(vocab, generator=g)[:vd].sort().values
    tensors = {
        "fc.weight": rand(h, len(aux_ids) * h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rand(vd, h),
        "d2t": used - torch.arange(vd),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    sizes = {"hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
             "max_position_embeddings": t.max_position}  # fmt: skip
    config = eagle3_config(sizes, aux_ids, vd, 10000.0, "float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def eagle3_config(
    sizes: dict[str, int],
    aux_ids: Sequence[int],
    draft_vocab_size: int,
    rope_theta: float,
    dtype: str,
) -> dict:
    """config.json of a one-layer EAGLE-3 head (SpecForge / SGLang keys): ``sizes`` holds the
    attention / MLP widths, ``vocab_size`` (the target's) and ``max_position_embeddings``."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **sizes,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)},
    }
