"""The corpus (the Python standard library's own sources), its split, the BPE tokenizer, windows.

The split is a pure function of each file's path relative to the stdlib root (a hash), so it
does not depend on the seed, the machine or which other files exist.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
# Folders that are tests, bundled tools or generated tables rather than ordinary library code.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "encodings", "pydoc_data", "__pycache__"}
)


@dataclass(frozen=True)
class Corpus:
    stdlib_dir: Path
    python_version: str  # e.g. "3.11.7"
    train_files: list[str]  # paths relative to stdlib_dir, sorted
    heldout_files: list[str]
    train_texts: list[str]  # same order as train_files
    heldout_texts: list[str]

    @property
    def num_train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_texts)

    @property
    def num_heldout_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.heldout_texts)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < heldout_percent


def list_stdlib_files(stdlib_dir: Path) -> list[str]:
    """Relative paths of the library's `.py` files, sorted, tests and tables excluded."""
    rel_paths = []
    for path in stdlib_dir.rglob("*.py"):
        rel = path.relative_to(stdlib_dir)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and not rel.name.startswith("_sysconfigdata"):
            rel_paths.append(rel.as_posix())
    return sorted(rel_paths)


def _read_capped(stdlib_dir: Path, rel_paths: list[str], max_bytes: int | None):
    kept, texts, total = [], [], 0
    for rel in rel_paths:
        try:
            text = (stdlib_dir / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if max_bytes is not None and total + len(text) > max_bytes and kept:
            break
        kept.append(rel)
        texts.append(text)
        total += len(text)
    return kept, texts


def load_corpus(
    heldout_percent: int, max_train_bytes: int | None = None, max_heldout_bytes: int | None = None
) -> Corpus:
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = list_stdlib_files(stdlib_dir)
    heldout = [p for p in rel_paths if is_heldout(p, heldout_percent)]
    train = [p for p in rel_paths if not is_heldout(p, heldout_percent)]
    train, train_texts = _read_capped(stdlib_dir, train, max_train_bytes)
    heldout, heldout_texts = _read_capped(stdlib_dir, heldout, max_heldout_bytes)
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Corpus(stdlib_dir, version, train, heldout, train_texts, heldout_texts)


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (lossless on any text); encoding with special tokens prepends `<|bos|>`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
    )


def encode_files(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[torch.Tensor]:
    """One int64 tensor per file: `<|bos|>`, the file's tokens, `<|eos|>`."""
    backend = tokenizer.backend_tokenizer
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [torch.tensor([bos, *enc.ids, eos], dtype=torch.int64) for enc in encodings]


def sample_windows(
    stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """`batch_size` random windows of `length` tokens from the concatenated stream."""
    starts = torch.randint(0, stream.numel() - length, (batch_size,), generator=generator)
    offsets = torch.arange(length)
    return stream[starts[:, None] + offsets[None, :]]  # [batch, length]


def heldout_windows(stream: torch.Tensor, num_windows: int, length: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows (deterministic)."""
    num_windows = min(num_windows, stream.numel() // length)
    stride = stream.numel() // num_windows
    starts = torch.arange(num_windows) * stride
    return stream[starts[:, None] + torch.arange(length)[None, :]]  # [num_windows, length]


def token_counts(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(stream, minlength=vocab_size)  # [vocab]
