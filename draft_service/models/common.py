"""What every draft loader does with its config before building the network."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specmesh.runtime.config import CheckpointError, ModelConfig


def resolve_draft_base(
    draft_dir: str | Path, base: ModelConfig, dtype: torch.dtype | None, embed_width: int
) -> ModelConfig:
    """Apply a dtype override and check that the draft's hidden size matches the target
    embedding it shares (EAGLE-style drafts embed tokens with the target's table)."""
    if base.hidden_size != embed_width:
        raise CheckpointError(
            f"{draft_dir}: draft hidden size {base.hidden_size} differs from the target "
            f"embedding width {embed_width}"
        )
    return base if dtype is None else replace(base, dtype=dtype)
