"""A Hugging Face Hub cache built on disk, as `huggingface_hub` lays one out, holding tiny
checkpoints saved by transformers (`runtime.tiny`): nothing is downloaded.

    HUB/models--ORG--NAME/refs/main              the commit hash
    HUB/models--ORG--NAME/blobs/<sha256>         each file's bytes
    HUB/models--ORG--NAME/snapshots/<commit>/F   a link to its blob
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

TARGET_ID, DRAFT_ID = "acme/tiny-llama", "acme/tiny-llama-eagle3"


def add_repo(
    hub: Path, repo_id: str, build: Callable[[Path], object], branch: str = "main"
) -> Path:
    """``build(folder)`` writes a checkpoint; it is stored as ``repo_id``'s snapshot on
    ``branch``. Returns the snapshot folder."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    staging = repo / "staging"
    build(staging)
    commit = hashlib.sha1(repo_id.encode() + branch.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.move(path, blob)
        link = snapshot / path.relative_to(staging)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    shutil.rmtree(staging)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def make_hub(root: Path) -> Path:
    """``root/hub`` with a tiny Llama (`TARGET_ID`) and an EAGLE-3 draft for it (`DRAFT_ID`)."""
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    hub = root / "hub"
    target = add_repo(hub, TARGET_ID, make_tiny_target)
    add_repo(hub, DRAFT_ID, lambda out: make_tiny_eagle3(out, target, draft_vocab_size=200))
    return hub


def offline_env(hub: Path) -> dict[str, str]:
    """The environment of a process that finds models only in ``hub``."""
    return {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}


def use_hub(monkeypatch: pytest.MonkeyPatch, hub: Path) -> None:
    """This process offline with ``hub`` as its Hub cache (huggingface_hub read the environment
    when it was imported, so its constants are set too)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
