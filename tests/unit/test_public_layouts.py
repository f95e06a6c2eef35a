"""The published layouts of the draft heads users download, shrunk to the tiny target.

Each checkpoint below carries exactly the config.json keys and tensor names of a public head
(sizes shrunk, values random), is loaded through the real loader (`load_draft`) and run through
the `Engine` with speculation; greedy output must equal transformers' greedy on the target, and
every tensor written must be the one the draft network holds.

    eagle3  the config SpecForge trains its Llama-3.1-8B-Instruct EAGLE-3 head with
            (SpecForge configs/llama3-8B-eagle3.json; the EAGLE authors' eagle/traineagle3/
            config.json has the same keys): LlamaForCausalLMEagle3, draft_vocab_size, no
            eagle_config (the target's default aux layers), no rope_theta (10000), no head_dim,
            torch_dtype float16. Tensors: fc.weight [H, 3H], midlayer.*, norm.weight,
            lm_head.weight [Vd, H], d2t (int64 offsets), t2d (bool over the target vocab).
    eagle   EAGLE-1/2 for Llama-3-8B-Instruct (SafeAILab/EAGLE eagle/train/
            EAGLE-LLaMA3-Instruct-8B.json): LlamaForCausalLM, rope_theta 500000, "bias": false.
            Tensors: fc.weight [H, 2H] (no bias), layers.0.* without input_layernorm, no norm,
            no lm_head (the target's).

The public files themselves are pytorch_model.bin for the EAGLE authors' heads; specmesh loads
safetensors only, so these are written as model.safetensors (same names, same shapes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.config import load_model_config

PROMPTS = [[5, 17, 42, 9], [100, 3, 3, 250, 61, 7]]
NEW_TOKENS = 12
SPEC = SpecParams(num_steps=3, topk=2, num_draft_tokens=6)
DRAFT_VOCAB = 200


def _llama_layer(rand, prefix: str, h: int, heads: int, kv_heads: int, inter: int, *,
                 in_width: int, input_norm: bool) -> dict:  # fmt: skip
    d = h // heads  # no head_dim key in the published configs: hidden / heads
    out = {
        f"{prefix}self_attn.q_proj.weight": rand(heads * d, in_width),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * d, in_width),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * d, in_width),
        f"{prefix}self_attn.o_proj.weight": rand(h, heads * d),
        f"{prefix}mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}mlp.up_proj.weight": rand(inter, h),
        f"{prefix}mlp.down_proj.weight": rand(h, inter),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(h),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = 1 + rand(h)
    return out


def _common_keys(t, arch: str, max_position: int) -> dict:
    """The keys both published configs share (transformers 4.28 LlamaConfig dump), shrunk."""
    return {
        "architectures": [arch],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": max_position,
        "model_type": "llama",
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": t.vocab_size,
    }


def write_eagle3_specforge(out: Path, target_dir: Path) -> dict[str, torch.Tensor]:
    t = load_model_config(target_dir)
    h = t.hidden_size
    g = torch.Generator().manual_seed(3)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).half()
    used = torch.randperm(t.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    tensors = {
        "fc.weight": rand(h, 3 * h),
        **_llama_layer(rand, "midlayer.", h, 2, 1, 96, in_width=2 * h, input_norm=True),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(DRAFT_VOCAB, h),
        "d2t": used - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(t.vocab_size, dtype=torch.bool).index_fill_(0, used, True),
    }
    config = {**_common_keys(t, "LlamaForCausalLMEagle3", 2048), "draft_vocab_size": DRAFT_VOCAB}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def write_eagle1_llama3(out: Path, target_dir: Path) -> dict[str, torch.Tensor]:
    t = load_model_config(target_dir)
    h = t.hidden_size
    g = torch.Generator().manual_seed(4)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).half()
    tensors = {
        "fc.weight": rand(h, 2 * h),
        **_llama_layer(rand, "layers.0.", h, 2, 1, 96, in_width=h, input_norm=False),
    }
    config = {**_common_keys(t, "LlamaForCausalLM", 2048), "rope_theta": 500000.0, "bias": False}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


LAYOUTS = {"eagle3": write_eagle3_specforge, "eagle": write_eagle1_llama3}


@pytest.fixture(scope="module")
def heads(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("public_layouts")
    return {kind: (root / kind, write(root / kind, tiny_dir / "target"))
            for kind, write in LAYOUTS.items()}  # fmt: skip


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_loader_holds_every_published_tensor(tiny_dir: Path, heads, kind):
    """Every tensor of the layout lands in the draft network, in the checkpoint's dtype; t2d is
    the one left out, and it is exactly the set d2t maps onto."""
    draft_dir, written = heads[kind]
    cfg = DraftConfig(kind=kind, draft_dir=str(draft_dir), target_dir=str(tiny_dir / "target"),
                      spec=SPEC, num_kv_slots=512, max_requests=4)  # fmt: skip
    net = load_draft(cfg).drafter.net
    held = net.state_dict()
    missing = [k for k in written if k != "t2d" and k not in held]
    assert not missing, f"published tensors the loader did not keep: {missing}"
    for k in written.keys() - {"t2d"}:
        assert torch.equal(held[k].cpu(), written[k].to(held[k].dtype)), k
        if written[k].is_floating_point():
            assert held[k].dtype == torch.float16, k  # the checkpoint's torch_dtype
    if kind == "eagle3":
        assert net.config.draft_vocab_size == DRAFT_VOCAB
        assert net.fc.in_features == 3 * net.hidden_size  # the target's default three aux layers
        assert net.fc.bias is None
        targets = torch.arange(DRAFT_VOCAB) + written["d2t"]
        assert torch.equal(written["t2d"].nonzero().flatten(), targets)
        assert net.config.base.rope.theta == 10000.0  # no rope_theta in the published config
    else:
        assert net.fc.bias is None  # "bias": false
        assert net.config.base.rope.theta == 500000.0


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_published_layout_greedy_equals_transformers(tiny_dir: Path, heads, oracle, kind):
    target = tiny_dir / "target"
    engine = Engine(target, draft_model=heads[kind][0], draft_kind=kind, spec=SPEC)
    results = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == [oracle(target, p, NEW_TOKENS) for p in PROMPTS]
    assert all(r.num_draft_tokens > 0 for r in results)  # the head proposed: rounds speculated
