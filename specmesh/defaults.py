"""The built-in default model: the committed demo pair when present, else a tiny random pair
built locally (no download) and cached under ``$SPECMESH_CACHE`` (default ~/.cache/specmesh)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_MODELS = Path(__file__).resolve().parents[1] / "models" / "demo"
# The tree shape `specmesh generate`, `specmesh up` and the demo's speed table run by default.
DEFAULT_SPEC = {"num_steps": 3, "topk": 4, "num_draft_tokens": 8}


@dataclass(frozen=True)
class ModelChoice:
    target: str
    draft: str | None
    draft_kind: str | None


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


def default_models() -> ModelChoice:
    demo_target, demo_draft = REPO_MODELS / "target", REPO_MODELS / "draft"
    if (demo_target / "config.json").is_file() and (demo_draft / "config.json").is_file():
        return ModelChoice(str(demo_target), str(demo_draft), "eagle3")
    tiny = cache_dir() / "tiny"
    if not (tiny / "draft" / "config.json").is_file():
        from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

        make_tiny_target(tiny / "target")
        make_tiny_eagle3(tiny / "draft", tiny / "target")
    return ModelChoice(str(tiny / "target"), str(tiny / "draft"), "eagle3")


def resolve_models(target: str | None, draft: str | None, kind: str | None) -> ModelChoice:
    """Fill in the default pair when no target is given; a target alone means no speculation
    unless a draft kind is named (``ngram`` needs no draft model)."""
    if target is None:
        if draft is not None:
            raise ValueError("--draft-model needs --target-model")
        chosen = default_models()
        return (
            chosen if kind in (None, chosen.draft_kind) else ModelChoice(chosen.target, None, kind)
        )
    return ModelChoice(target, draft, kind if kind or draft is None else "eagle3")


def local_models(
    chosen: ModelChoice, target_revision: str | None = None, draft_revision: str | None = None
) -> ModelChoice:
    """``chosen`` with each model a local directory: Hugging Face ids resolved (and downloaded
    when online) by `specmesh.hub.resolve_model`."""
    from specmesh.hub import resolve_model

    target = resolve_model(chosen.target, target_revision, "--target-model")
    draft = chosen.draft and resolve_model(chosen.draft, draft_revision, "--draft-model")
    return ModelChoice(target, draft, chosen.draft_kind)
