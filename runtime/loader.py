"""safetensors loading (single file or sharded index). Never pickle."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from specmesh.runtime.config import CheckpointError


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise CheckpointError(f"{model_dir}: only pickle weights found; specmesh loads safetensors")
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_tensors(
    model_dir: str | Path, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (or just ``names``), on CPU, in their stored dtype."""
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if wanted is None or key in wanted:
                    out[key] = f.get_tensor(key)
    return out


def assign_parameters(
    module: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    rename: dict[str, str] | None = None,
    *,
    what: str,
) -> None:
    """Copy ``tensors`` into ``module``'s parameters and buffers by name (after ``rename``), checking
    that every parameter is present and every shape matches. Errors name the tensor."""
    rename = rename or {}
    own = module.state_dict(keep_vars=True)  # parameters and persistent buffers
    for ckpt_name, target_name in rename.items():
        if ckpt_name in tensors:
            tensors[target_name] = tensors.pop(ckpt_name)
    for name, param in own.items():
        if name not in tensors:
            raise CheckpointError(f"{what}: checkpoint is missing tensor {name!r}")
        src = tensors[name]
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{what}: tensor {name!r} has shape {list(src.shape)}, expected {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(src.to(param.dtype))
