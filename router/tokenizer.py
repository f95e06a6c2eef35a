"""Tokenizer loading (the checkpoint's own files, never a download) and seed resolution."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def resolve_seed(seed: int | None) -> int:
    """A request without a seed gets one now, so a replay on another replica samples the same."""
    return secrets.randbits(62) if seed is None else seed
