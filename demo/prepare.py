"""A run's data: corpus -> BPE tokenizer -> token streams, moved once to the training device."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from specmesh.demo import data as demo_data
from specmesh.demo.config import DemoConfig
from specmesh.demo.corpus import Corpus, load_corpus
from specmesh.demo.progress import Progress


@dataclass(frozen=True)
class PreparedData:
    corpus: Corpus
    tokenizer: PreTrainedTokenizerFast
    train_stream: torch.Tensor  # [train_tokens] int64, files concatenated, on the device
    heldout_stream: torch.Tensor  # [heldout_tokens] int64, on the device
    eval_only_stream: torch.Tensor  # [eval_only_tokens] int64, empty without extra sources
    byte_lengths: torch.Tensor  # [vocab] int64, UTF-8 bytes per token, on the device
    seconds: float  # wall-clock time of the whole preparation


def prepare_data(
    cfg: DemoConfig,
    device: torch.device,
    log: Progress,
    stdlib_dir: Path | None = None,
    package_roots: list[Path] | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> PreparedData:
    """``tokenizer``: an earlier run's, whose target this run continues (none is learned)."""
    start = time.monotonic()
    corpus = load_corpus(cfg, stdlib_dir, package_roots)
    sizes = ", ".join(
        f"{s.name} {s.num_files} files {s.num_bytes / 1e6:.1f} MB" for s in corpus.sources
    )
    log.note(f"corpus read in {time.monotonic() - start:.1f}s: {sizes}")
    if tokenizer is None:
        tokenizer = learn_tokenizer(cfg, corpus, log)
    mark = time.monotonic()
    streams = [
        demo_data.encode_stream(tokenizer, text.texts).to(device)
        for text in (corpus.train, corpus.heldout, corpus.eval_only)
    ]
    log.note(
        f"encoded {sum(s.numel() for s in streams):,} tokens in {time.monotonic() - mark:.1f}s "
        f"(data ready after {time.monotonic() - start:.1f}s)"
    )
    byte_lengths = demo_data.token_byte_lengths(tokenizer).to(device)
    return PreparedData(corpus, tokenizer, *streams, byte_lengths, time.monotonic() - start)


def learn_tokenizer(cfg: DemoConfig, corpus: Corpus, log: Progress) -> PreTrainedTokenizerFast:
    mark = time.monotonic()
    texts = corpus.train.sample(cfg.tokenizer_train_bytes)
    tokenizer = demo_data.train_tokenizer(texts, cfg.vocab_size, cfg.max_position_embeddings)
    num_chars = sum(len(t) for t in texts)
    log.note(f"tokenizer trained on {num_chars / 1e6:.1f}M chars in {time.monotonic() - mark:.1f}s")
    return tokenizer


def hot_vocab(cfg: DemoConfig, prepared: PreparedData) -> tuple[torch.Tensor, float]:
    """The `draft_vocab_size` most frequent training ids (eos always in), ascending; coverage."""
    counts = demo_data.token_counts(prepared.train_stream, len(prepared.tokenizer)).double()
    ranking = counts.clone()
    ranking[prepared.tokenizer.eos_token_id] = float("inf")
    hot_ids = ranking.topk(cfg.draft_vocab_size).indices.sort().values
    return hot_ids, float(counts[hot_ids].sum() / counts.sum())
