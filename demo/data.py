"""The BPE tokenizer, token streams and the windows cut from them.

A stream is files concatenated as `<|bos|>` file `<|eos|>`; training samples random windows of
it, evaluation evenly spaced or covering ones. Streams may live on any device; the random
window starts always come from a CPU generator, so a seed picks the same windows everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
ENCODE_CHUNK_CHARS = 32_000_000  # text per `encode_batch` call (bounds the encodings held)


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


def _chunks(texts: list[str], max_chars: int) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for text in texts:
        if chunk and chars + len(text) > max_chars:
            yield chunk
            chunk, chars = [], 0
        chunk.append(text)
        chars += len(text)
    if chunk:
        yield chunk


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """[num_tokens] int64 on the CPU: each file as `<|bos|>`, its tokens, `<|eos|>`, in order."""
    bos = np.array([tokenizer.bos_token_id], dtype=np.int64)
    eos = np.array([tokenizer.eos_token_id], dtype=np.int64)
    pieces = [np.zeros(0, dtype=np.int64)]
    for chunk in _chunks(texts, ENCODE_CHUNK_CHARS):
        for enc in tokenizer.backend_tokenizer.encode_batch(chunk, add_special_tokens=False):
            pieces += [bos, np.array(enc.ids, dtype=np.int64), eos]
    return torch.from_numpy(np.concatenate(pieces))


def token_byte_lengths(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """[vocab] int64: UTF-8 bytes each token decodes to (byte-level BPE: one character per
    byte), 0 for the special tokens; summed over a stream, the bytes of its files."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_tokens)
    return torch.tensor([0 if t in special else len(t) for t in tokens], dtype=torch.int64)


def _windows_at(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    offsets = torch.arange(length, device=stream.device)
    return stream[starts.to(stream.device)[:, None] + offsets[None, :]]  # [len(starts), length]


def sample_windows(
    stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """`batch_size` random windows of `length` tokens from the concatenated stream."""
    starts = torch.randint(0, stream.numel() - length, (batch_size,), generator=generator)
    return _windows_at(stream, starts, length)  # [batch, length]


def heldout_windows(stream: torch.Tensor, num_windows: int, length: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows (deterministic)."""
    num_windows = min(num_windows, stream.numel() // length)
    stride = stream.numel() // num_windows
    return _windows_at(stream, torch.arange(num_windows) * stride, length)  # [num_windows, length]


def covering_windows(stream: torch.Tensor, length: int) -> list[torch.Tensor]:
    """Windows of `length` overlapping by one token, then a shorter last one, so that every
    token after the first is predicted exactly once: [[num_full, length], [1, rest]]."""
    stride = length - 1
    num_full = max(stream.numel() - 1, 0) // stride
    full = _windows_at(stream, torch.arange(num_full) * stride, length)
    rest = stream[num_full * stride :][None]  # [1, rest]
    return [w for w in (full, rest) if w.shape[0] and w.shape[1] > 1]


def token_counts(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(stream, minlength=vocab_size)  # [vocab]
