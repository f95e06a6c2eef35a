"""The standalone draft the benchmark uses when none is given: the target's first layers.

A "layer-skip" draft keeps the target's embedding, its first ``num_layers`` decoder layers, its
final norm and its LM head, and drops the rest: a real ``LlamaForCausalLM`` (or Qwen) checkpoint
with the target's tokenizer, made without training, whose guesses agree with the target often
enough to make drafting worth measuring. Both specmesh's standalone drafter and transformers'
assisted generation (``assistant_model=``) load the same directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

NUM_LAYERS = 2
CONFIG_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
)  # fmt: skip


def target_cache_dir(target_dir: str) -> Path:
    """Where the benchmark keeps what it derives from one target (drafts, GGUF files)."""
    from specmesh.defaults import cache_dir

    resolved = Path(target_dir).resolve()
    key = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    return cache_dir() / "bench" / f"{resolved.name}-{key}"


def default_draft_dir(target_dir: str, num_layers: int = NUM_LAYERS) -> Path:
    return target_cache_dir(target_dir) / f"first{num_layers}layers"


def layer_skip_draft(target_dir: str, out_dir: Path, num_layers: int = NUM_LAYERS) -> Path:
    """Write (once) the first ``num_layers`` layers of ``target_dir`` as a checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    target = Path(target_dir)
    config = json.loads((target / "config.json").read_text())
    if num_layers < 1 or num_layers >= config["num_hidden_layers"]:
        raise ValueError(
            f"a layer-skip draft needs 1 <= num_layers < {config['num_hidden_layers']} "
            f"(the target's layers), got {num_layers}"
        )
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = [k for k in f.keys() if _kept(k, num_layers)]  # noqa: SIM118 (not a dict)
            tensors |= {k: f.get_tensor(k) for k in names}
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)  # written aside, renamed when complete
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for name in CONFIG_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, tmp / name)
    tmp.replace(out_dir)
    return out_dir


def _kept(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    if "layers" not in parts:
        return True  # embedding, final norm, LM head
    return int(parts[parts.index("layers") + 1]) < num_layers


def tiny_deepseek_dir() -> Path:
    """A tiny DeepSeek-V3 target (one MLA + MoE layer, YaRN) with its own NextN layer, written
    once under the cache (`specmesh bench --tiny-deepseek`). The NextN layer copies the target's
    block and passes the embedding through (`runtime.tiny_nextn.add_nextn_layer`), so the MTP
    draft's guesses are mostly right: a stand-in for a trained one, on the model family's real
    code paths (latent cache, absorbed attention, grouped routing)."""
    from specmesh.defaults import cache_dir
    from specmesh.runtime.tiny import make_tiny_deepseek

    out = cache_dir() / "bench" / "tiny-deepseek-v3-nextn"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_deepseek(tmp, num_hidden_layers=1, first_k_dense_replace=0, nextn_copies_layer=0)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out
