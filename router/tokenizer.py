"""The router's tokenizer: ``--tokenizer DIR``, else the one its targets serve (``GetTokenizer``),
loaded from the checkpoint's own files (never a download); and seed resolution.

Fetched, every target replica's reply is checked against its digest and all replicas must send
the same one (`specmesh.rpc.tokenizer_files`); the files are written to a private temporary
folder (mode 0700), loaded by `load_tokenizer` exactly as a local checkpoint is, and the folder
is deleted once loaded (the tokenizer, chat template included, lives in memory from then on).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specmesh.rpc.tokenizer_files import TokenizerFiles

if TYPE_CHECKING:
    from specmesh.router.grpc_clients import GrpcTargetClient

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_tokenizer_files(files: TokenizerFiles) -> Any:
    """`load_tokenizer` over ``files`` (their names already checked: plain, allowed names)."""
    with tempfile.TemporaryDirectory(prefix="specmesh-tokenizer-") as folder:
        for name, content in files.files:
            (Path(folder) / name).write_bytes(content)
        return load_tokenizer(folder)


async def fetch_tokenizer(targets: Sequence[GrpcTargetClient]) -> Any | None:
    """The tokenizer every target replica serves, or None when none serves one (the router then
    takes token ids only, and says so here, once). Replicas that disagree (different digests,
    or some without a tokenizer) refuse the start with a ValueError naming each."""
    replies = await asyncio.gather(*(t.get_tokenizer() for t in targets))
    digests = {
        t.name: r.sha256 if r is not None else None for t, r in zip(targets, replies, strict=True)
    }
    if len(set(digests.values())) > 1:
        listing = "; ".join(f"{name}: {d or 'no tokenizer'}" for name, d in digests.items())
        raise ValueError(
            f"target replicas serve different tokenizers (sha256 {listing}): serve one "
            "checkpoint behind a router, or give the router --tokenizer DIR"
        )
    files = replies[0]
    if files is None:
        log.warning(
            "no tokenizer: the targets serve none and --tokenizer was not given; text prompts "
            "and chat are refused, token-id prompts are answered with empty text"
        )
        return None
    tokenizer = await asyncio.to_thread(load_tokenizer_files, files)
    log.info(
        "tokenizer fetched from %d target(s): %s (%d bytes, sha256 %s)",
        len(targets), ", ".join(n for n, _ in files.files), files.num_bytes, files.sha256,
    )  # fmt: skip
    return tokenizer


def resolve_seed(seed: int | None) -> int:
    """A request without a seed gets one now, so a replay on another replica samples the same."""
    return secrets.randbits(62) if seed is None else seed
