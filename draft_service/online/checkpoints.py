"""Checkpoints of the learned head (``--online-learning-dir DIR``), in the EAGLE-3 format the
draft loads, so ``specmesh draft --model DIR/latest`` serves one like any other head:

    DIR/
      v000003/     config.json (the shipped draft's), model.safetensors, online.json
      v000004/
      latest       symlink -> v000004

A checkpoint is written under a temporary name, then renamed; `latest` is a new symlink renamed
over the old one. A draft killed at any point leaves `latest` naming a whole checkpoint (or
none), and a draft started on DIR resumes from it; what a killed write left is removed then.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specmesh.runtime.loader import load_tensors

LATEST = "latest"
PREFIX = "v"


@dataclass(frozen=True)
class Checkpoint:
    version: int
    path: Path


class Checkpoints:
    def __init__(self, root: str | Path, shipped_dir: str | Path, dtype: torch.dtype, keep: int):
        self.root, self.shipped_dir = Path(root), Path(shipped_dir)
        self.dtype, self.keep = dtype, keep
        self.root.mkdir(parents=True, exist_ok=True)
        for left in self.root.glob(".*.tmp"):  # a write that did not finish
            if left.is_symlink() or left.is_file():
                left.unlink()
            else:
                shutil.rmtree(left)
        self.t2d = load_tensors(self.shipped_dir, ["t2d"]).get("t2d")

    def latest(self) -> Checkpoint | None:
        link = self.root / LATEST
        if not link.is_symlink():
            return None
        path = self.root / os.readlink(link)
        info = json.loads((path / "online.json").read_text())
        return Checkpoint(int(info["version"]), path)

    def load(self, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, by the served module's names (``t2d`` left out)."""
        tensors = load_tensors(checkpoint.path)
        tensors.pop("t2d", None)
        return tensors

    def save(self, version: int, tensors: dict[str, torch.Tensor], info: dict) -> Checkpoint:
        """Write ``tensors`` (the served module's state dict) as version ``version``."""
        name = f"{PREFIX}{version:06d}"
        tmp, final = self.root / f".{name}.tmp", self.root / name
        tmp.mkdir()
        out = {
            k: (v.to(self.dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in tensors.items()
        }
        if self.t2d is not None:
            out["t2d"] = self.t2d
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(self.shipped_dir / "config.json", tmp / "config.json")
        meta = {"version": version, "shipped": self.shipped_dir.name, "saved_at": time.time()}
        (tmp / "online.json").write_text(json.dumps({**meta, **info}, indent=2) + "\n")
        _sync(tmp)
        if final.exists():  # a version written before a restart that did not reach `latest`
            shutil.rmtree(final)
        os.replace(tmp, final)
        link = self.root / f".{LATEST}.tmp"
        link.symlink_to(name)
        os.replace(link, self.root / LATEST)
        self._prune(name)
        return Checkpoint(version, final)

    def _prune(self, newest: str) -> None:
        kept = sorted(p.name for p in self.root.glob(f"{PREFIX}[0-9]*") if p.is_dir())
        for old in kept[: -self.keep]:
            if old != newest:
                shutil.rmtree(self.root / old)


def _sync(folder: Path) -> None:
    """Flush the folder's files to disk before it is renamed into place."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
