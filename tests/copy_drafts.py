"""Drafts built to predict their target, so that a speculative test sees tokens accepted.

A random draft's tokens are all rejected, and a test that compares speculative output with
transformers' then never runs an accepted path: the KV kept for it, the bonus token after it, a
stop that cuts a run of accepted tokens. These drafts are built, not trained, around one target:

    target      a one-layer tiny Llama whose embedding rows have unit RMS (the pad row stays zero),
                so its layer's input norm (weight 1) leaves an embedding as it is
    eagle       EAGLE-1: ``fc`` passes the token's embedding, the layer is the target's (EAGLE-1
                has no input norm; the embedding needs none), the target's head reads the output
                (the final norm has weight 1: it only scales a row, the argmax stays)
    mtp         every layer: ``eh_proj`` passes ``enorm(e) = e``, then the target's layer and
                final norm
    eagle3      ``fc`` = 0 and q / k / v read the embedding half only; o_proj, MLP, norm and head
                are the target's. The extend rows miss only the embedding's residual, so the
                root's children are mostly right; a deeper node adds its parent's output to the
                residual and is accepted less often
    standalone  the target with 1 % noise on every weight

Row p of an EAGLE or MTP draft holds token p + 1: each recomputes the target on the context
without its first token, which the target's output mostly does not hinge on, so drafts are
accepted often but not always. `make_copy_llava` does the same for a LLaVA's language model and
an EAGLE-3 draft; there the embedding rows are small (RMS 0.05: that model's layer is at a
smaller init scale, and the residual EAGLE-3 drops must stay minor). Losslessness never depends
on any of this, only acceptance.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target
from specmesh.runtime.tiny_drafts import make_tiny_draft
from specmesh.runtime.tiny_llava import make_tiny_llava, make_tiny_llava_eagle3
from specmesh.runtime.tiny_nextn import add_nextn_layer, export_nextn

KINDS = ("eagle3", "eagle", "mtp", "standalone")
DEEPSEEK = "DeepseekV3ForCausalLM"


@dataclass
class OneLayerLM:
    """The tensors of a one-layer language model that its drafts copy."""

    layer: dict[str, torch.Tensor]  # decoder layer 0, names below ``layers.0.``
    norm: torch.Tensor  # the final norm's weight [H]
    head: torch.Tensor  # the LM head [vocab, H]


def make_copy_pair(root: Path, seed: int = 0, **dims: object) -> Path:
    """``root/target`` and ``root/<kind>`` for every kind of `KINDS`; returns ``root``.
    ``dims``: the target's, as `make_tiny_target` takes them (one layer always)."""
    target = make_tiny_target(root / "target", seed=seed, **{**dims, "num_hidden_layers": 1})
    lm = _copyable(target / "model.safetensors", "model.", "lm_head.weight")
    hidden = lm.norm.shape[0]
    passthrough = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)  # [H, 2H]
    _eagle(make_tiny_draft(root / "eagle", target, "eagle", seed=seed + 1), lm, passthrough)
    _mtp(make_tiny_draft(root / "mtp", target, "mtp", seed=seed + 1), lm, passthrough)
    _eagle3(make_tiny_eagle3(root / "eagle3", target, seed=seed + 1, aux_layer_ids=[0, 0, 0]), lm)
    _noisy_copy(target, root / "standalone", seed)
    return root


def make_copy_llava(root: Path, seed: int = 0) -> Path:
    """``root/target``, a tiny LLaVA whose language model is cut to one layer (as above), and
    ``root/draft``, an EAGLE-3 draft copying it; returns ``root``."""
    target = make_tiny_llava(root / "target", seed=seed)
    path, prefix = target / "model.safetensors", "language_model.model."
    weights = load_file(path)
    extra = [k for k in weights if k.startswith(prefix + "layers.") and
             not k.startswith(prefix + "layers.0.")]  # fmt: skip
    _save(path, {k: v for k, v in weights.items() if k not in extra})
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 1
    (target / "config.json").write_text(json.dumps(config, indent=2))
    lm = _copyable(path, prefix, "language_model.lm_head.weight", rms=0.05)
    draft = make_tiny_llava_eagle3(root / "draft", target, seed=seed + 1, aux_layer_ids=[0, 0, 0])
    _eagle3(draft, lm)
    return root


def make_copy_mla_llava(root: Path, seed: int = 0) -> Path:
    """``root/target``, a tiny LLaVA whose language model is a one-layer DeepSeek-V3 (MLA, MoE),
    and ``root/nextn``, a NextN layer copying that layer (`runtime.tiny_nextn.add_nextn_layer`'s
    ``copy_layer``) in SGLang's export layout; returns ``root``."""
    target = make_tiny_llava(root / "target", seed=seed, text="deepseek", num_hidden_layers=1,
                             first_k_dense_replace=0)  # fmt: skip
    # The language model alone, as a DeepSeek checkpoint, to write its NextN layer beside it.
    plain = root / "plain"
    plain.mkdir()
    text = json.loads((target / "config.json").read_text())["text_config"]
    (plain / "config.json").write_text(json.dumps({**text, "architectures": [DEEPSEEK]}))
    names = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
    tensors = {
        names[p] + k.removeprefix(p): v
        for k, v in load_file(target / "model.safetensors").items()
        for p in names
        if k.startswith(p)
    }
    _save(plain / "model.safetensors", tensors)
    add_nextn_layer(plain, seed=seed + 1, copy_layer=0)
    export_nextn(plain, root / "nextn")
    return root


def _copyable(path: Path, prefix: str, head: str, rms: float = 1.0) -> OneLayerLM:
    """Give the checkpoint's embedding rows an RMS of ``rms`` (the pad row stays zero); its
    tensors."""
    weights = load_file(path)
    embed = weights[prefix + "embed_tokens.weight"]  # [vocab, H]
    scale = rms / embed.pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6)
    weights[prefix + "embed_tokens.weight"] = embed * scale
    _save(path, weights)
    layer = prefix + "layers.0."
    own = {k.removeprefix(layer): v for k, v in weights.items() if k.startswith(layer)}
    return OneLayerLM(own, weights[prefix + "norm.weight"], weights[head])


def _eagle(draft: Path, lm: OneLayerLM, passthrough: torch.Tensor) -> None:
    tensors = load_file(draft / "model.safetensors")
    tensors["fc.weight"], tensors["fc.bias"] = passthrough, torch.zeros(passthrough.shape[0])
    own = {k: v for k, v in lm.layer.items() if k != "input_layernorm.weight"}
    tensors.update({"layers.0." + k: v for k, v in own.items()})
    _save(draft / "model.safetensors", tensors)


def _mtp(draft: Path, lm: OneLayerLM, passthrough: torch.Tensor) -> None:
    tensors = load_file(draft / "model.safetensors")
    num = json.loads((draft / "config.json").read_text())["num_nextn_predict_layers"]
    for i in range(num):
        p = f"model.layers.{1 + i}."  # after the target's one layer
        tensors.update({p + k: v for k, v in lm.layer.items()})
        tensors[p + "eh_proj.weight"] = passthrough
        tensors[p + "shared_head.norm.weight"] = lm.norm
    _save(draft / "model.safetensors", tensors)


def _eagle3(draft: Path, lm: OneLayerLM) -> None:
    tensors = load_file(draft / "model.safetensors")
    tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"])
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    for name in qkv:  # the embedding half; the hidden half reads nothing
        w = lm.layer[name + ".weight"]
        tensors[f"midlayer.{name}.weight"] = torch.cat([w, torch.zeros_like(w)], 1)
    tensors.update({"midlayer." + k: v for k, v in lm.layer.items() if not k.startswith(qkv)})
    tensors["norm.weight"], tensors["lm_head.weight"] = lm.norm, lm.head
    vocab = lm.head.shape[0]  # the whole vocabulary
    tensors["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    _save(draft / "model.safetensors", tensors)
    config = json.loads((draft / "config.json").read_text())
    config["draft_vocab_size"] = vocab
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def _noisy_copy(target: Path, out: Path, seed: int) -> None:
    shutil.copytree(target, out)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(out / "model.safetensors")
    noisy = {
        k: v + 0.01 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()
    }
    _save(out / "model.safetensors", noisy)


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor its own copy: the drafts' layers share the target's."""
    save_file({k: v.clone() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
