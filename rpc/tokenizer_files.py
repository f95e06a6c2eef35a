"""The tokenizer a target serves (``Target/GetTokenizer``), so a router needs no copy of the
checkpoint: which files travel, the digest over them, and the checks at both ends.

What is sent: the files of `TOKENIZER_FILES` that the checkpoint directory holds, by plain name
(never a path or a folder: ``additional_chat_templates/`` stays behind), sorted by name, plus
``config.json`` (AutoTokenizer reads the model type from it when ``tokenizer_config.json`` names
no tokenizer class). A checkpoint with none of `TOKENIZER_FILES` has no tokenizer (NOT_FOUND).
Sizes are read from the directory before any content, and all files together must fit one
message of the target's ``--max-message-mb`` less `MESSAGE_HEADROOM` (else RESOURCE_EXHAUSTED).

The digest (`tokenizer_digest`): sha256 over the files in that order, each one adding its name
in UTF-8, one NUL byte, its size as an 8-byte big-endian unsigned integer, then its bytes, so no
two different sets of files hash alike by shifting bytes between names and contents. The router
recomputes it over what it received (a reply damaged on the way is refused) and requires every
target replica to send the same one. It protects against damage and mismatched replicas, not
against a hostile target (which the router's mTLS already has to trust).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specmesh.protocol.errors import SpecmeshError
from specmesh.v1 import target_pb2

# What AutoTokenizer reads from a checkpoint: fast and slow tokenizers, special tokens, chat
# templates (`chat_template.json`: the older processors' spelling).
TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)
COMPANION_FILES = ("config.json",)  # sent only beside a tokenizer
ALLOWED_NAMES = frozenset(TOKENIZER_FILES + COMPANION_FILES)
MESSAGE_HEADROOM = 64 << 10  # names, field tags and the digest, with room to spare


class NoTokenizerError(SpecmeshError):
    grpc_code = "NOT_FOUND"


class TokenizerTooLargeError(SpecmeshError):
    grpc_code = "RESOURCE_EXHAUSTED"


class TokenizerDigestError(ValueError):
    """A reply whose files are not what its digest says, or that names a file outside the
    list: the router refuses to start."""


@dataclass(frozen=True)
class TokenizerFiles:
    """One checkpoint's tokenizer files, as `GetTokenizer` sends them (the target builds it with
    `read_tokenizer_files`, the router checks a reply with `from_pb`)."""

    files: tuple[tuple[str, bytes], ...]  # (name, content), sorted by name, names unique
    sha256: str  # `tokenizer_digest(files)`, lower-case hex

    @property
    def num_bytes(self) -> int:
        return sum(len(content) for _, content in self.files)

    def to_pb(self) -> target_pb2.TokenizerFiles:
        files = [target_pb2.TokenizerFile(name=n, content=c) for n, c in self.files]
        return target_pb2.TokenizerFiles(files=files, sha256=self.sha256)

    @staticmethod
    def from_pb(msg: target_pb2.TokenizerFiles, peer: str) -> TokenizerFiles:
        """The reply, once its names are allowed, sorted and unique and its digest holds."""
        files = tuple((f.name, f.content) for f in msg.files)
        names = [name for name, _ in files]
        bad = sorted(set(names) - ALLOWED_NAMES)
        if bad:
            raise TokenizerDigestError(f"{peer}: GetTokenizer sent files outside the list: {bad}")
        if names != sorted(set(names)):
            raise TokenizerDigestError(
                f"{peer}: GetTokenizer files not sorted or repeated: {names}"
            )
        digest = tokenizer_digest(files)
        if digest != msg.sha256:
            raise TokenizerDigestError(
                f"{peer}: the tokenizer files do not match their digest (reply says sha256 "
                f"{msg.sha256 or '<none>'}, the {len(files)} files received hash to {digest}): "
                "damaged on the way, or a broken target"
            )
        return TokenizerFiles(files, digest)


def tokenizer_digest(files: tuple[tuple[str, bytes], ...]) -> str:
    """sha256 over ``files`` in their order (the module docstring defines the framing)."""
    h = hashlib.sha256()
    for name, content in files:
        h.update(name.encode())
        h.update(b"\0")
        h.update(len(content).to_bytes(8, "big"))
        h.update(content)
    return h.hexdigest()


def read_tokenizer_files(model_dir: str | Path, max_bytes: int) -> TokenizerFiles:
    """The tokenizer files of ``model_dir``: NOT_FOUND without any, RESOURCE_EXHAUSTED when they
    total more than ``max_bytes`` (checked on sizes, before reading)."""
    folder = Path(model_dir)
    present = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if not present:
        raise NoTokenizerError(
            f"{folder.name}: the checkpoint has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        )
    names = sorted(present + [n for n in COMPANION_FILES if (folder / n).is_file()])
    sizes = {n: (folder / n).stat().st_size for n in names}
    total = sum(sizes.values())
    if total > max_bytes:
        biggest = max(sizes, key=sizes.get)
        raise TokenizerTooLargeError(
            f"{folder.name}: tokenizer files of {total:,} bytes ({biggest} {sizes[biggest]:,}) "
            f"exceed this target's message limit less headroom, {max_bytes:,} bytes: raise "
            "--max-message-mb on the target and router, or give the router --tokenizer DIR"
        )
    files = tuple((n, (folder / n).read_bytes()) for n in names)
    return TokenizerFiles(files, tokenizer_digest(files))
