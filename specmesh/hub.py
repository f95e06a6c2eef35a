"""Where a model named on the command line (or given to `Engine`) lives: a local checkpoint
directory, or a Hugging Face Hub id resolved to a snapshot in the Hub cache.

    --model DIR                       the directory itself (absolute)
    --model ORG/NAME [--revision R]   $HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/

A Hub id is looked up through `huggingface_hub`: its cache first, then the Hub when online,
downloading only the files a checkpoint needs (`CHECKPOINT_FILES`, then the shards its
safetensors index lists), never pickle weights or other formats. With ``HF_HUB_OFFLINE=1``
nothing is asked of the network, and an id the cache lacks is a `ValueError` naming it. A
snapshot is served under its Hub id, not its commit (`specmesh.rpc.security.model_name`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specmesh.rpc.tokenizer_files import TOKENIZER_FILES

# What a served checkpoint reads: its config, weights (one file or an index of shards),
# tokenizer and chat template, generation defaults, and a LLaVA target's image processor.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "processor_config.json",
    *TOKENIZER_FILES,
)
SHARD_INDEX = "model.safetensors.index.json"


def resolve_model(model: str | Path, revision: str | None = None, what: str = "model") -> str:
    """The local directory of ``model``: an existing directory as an absolute path (``revision``
    does not apply), else the Hub snapshot of the id ``model`` at ``revision`` (default: main).
    ``what`` names the flag in errors (``--target-model``)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return os.path.abspath(path)
    repo_id = str(model)
    if not _is_repo_id(repo_id):
        raise ValueError(f"{what} {repo_id}: no such directory (nor a Hugging Face id ORG/NAME)")
    try:
        return _snapshot(repo_id, revision)
    except OSError as e:  # huggingface_hub's errors: not cached, not found, unreachable
        raise ValueError(_explain(what, repo_id, revision, e)) from None


def _is_repo_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now or when huggingface_hub was
    imported."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or now.upper() in ("1", "ON", "YES", "TRUE")


def _snapshot(repo_id: str, revision: str | None) -> str:
    """The snapshot folder, the checkpoint's files first, then the shards its index names (both
    calls return the cached folder as it is when offline)."""
    from huggingface_hub import snapshot_download

    fetch = lambda files: snapshot_download(
        repo_id, revision=revision, allow_patterns=list(files), local_files_only=offline()
    )
    folder = Path(fetch(CHECKPOINT_FILES))
    index = folder / SHARD_INDEX
    if index.is_file() and not offline():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        folder = Path(fetch(shards))
    return str(folder)


def _explain(what: str, repo_id: str, revision: str | None, error: OSError) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{what} {repo_id}" + (f" (revision {revision})" if revision else "")
    cache = constants.HF_HUB_CACHE
    if isinstance(error, RevisionNotFoundError):
        return f"{name}: the Hub has no such revision"
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"{name}: not a local directory, and the Hub has no such model or it is gated or "
            "private (log in with `hf auth login`, or set HF_TOKEN)"
        )
    if isinstance(error, LocalEntryNotFoundError) and offline():
        return (
            f"{name}: not a local directory and not in the Hugging Face cache ({cache}); "
            "HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it where the Hub can be "
            f"reached (`hf download {repo_id}`) or unset HF_HUB_OFFLINE"
        )
    return (
        f"{name}: not a local directory, not in the Hugging Face cache ({cache}), and the Hub "
        f"could not be reached ({type(error).__name__}: {error})"
    )
