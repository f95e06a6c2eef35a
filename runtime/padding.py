"""Static-shape batches: pad a ragged batch to a captured size, then cut every output back.

A CUDA-graph (or any static-shape) runner replays a graph captured for ``num_tokens`` rows, so a
batch of ``raw_num_tokens`` rows is padded with dummy rows. The contract, invariant 2 of
DESIGN.md (seed 001: SGLang once returned ``mm_input_embeds`` of the padded size):

    items   = pad_batch(items, bucket_size(raw, buckets))   dummy rows go LAST, in their own
                                                            request, so real rows never see them
    out     = <replay / forward>(items)                     [num_tokens, ...] in every field
    out     = unpad(out, raw)                               [raw, ...] in EVERY tensor field

`unpad` is one generic call on the output type (``select`` slices each tensor field), so a field
added later cannot be forgotten. A graph runner must call it on every output it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch

from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, ForwardModel, run_batch

PAD_RID = "__pad__"  # the dummy request that owns the padding rows' KV


class Selectable(Protocol):
    def select(self, index: torch.Tensor | slice) -> Selectable: ...


Output = TypeVar("Output", bound=Selectable)


def bucket_size(num_tokens: int, buckets: Sequence[int]) -> int:
    """The smallest captured size that holds ``num_tokens`` rows."""
    fits = [b for b in buckets if b >= num_tokens]
    if not fits:
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {max(buckets, default=0)}")
    return min(fits)


def pad_batch(items: list[BatchItem], num_tokens: int, pad_rid: str = PAD_RID) -> list[BatchItem]:
    """``items`` plus one dummy request of zero ids (and zero embeddings when the batch carries
    ``input_embeds``) filling the batch to ``num_tokens`` rows."""
    raw = sum(it.q_len for it in items)
    if num_tokens < raw:
        raise ValueError(f"cannot pad a batch of {raw} tokens down to {num_tokens}")
    if num_tokens == raw:
        return items
    n = num_tokens - raw
    ref = next((it.input_embeds for it in items if it.input_embeds is not None), None)
    embeds = None if ref is None else ref.new_zeros(n, ref.shape[-1])  # [n, hidden]
    ids = items[0].input_ids.new_zeros(n) if items else torch.zeros(n, dtype=torch.int64)
    return [*items, BatchItem(pad_rid, ids, 0, input_embeds=embeds)]


def unpad(out: Output, raw_num_tokens: int) -> Output:
    """Cut EVERY tensor field of ``out`` back to the first ``raw_num_tokens`` rows."""
    return out.select(slice(0, raw_num_tokens))  # type: ignore[return-value]


def run_padded(
    model: ForwardModel,
    cache: KVCache,
    backend: AttentionBackend,
    items: list[BatchItem],
    num_tokens: int,
) -> Selectable:
    """Reference static-shape forward: pad to ``num_tokens``, run, unpad. The dummy request's KV
    is taken for the call and freed after it (a graph runner keeps a scratch slot instead)."""
    raw = sum(it.q_len for it in items)
    cache.add(PAD_RID)
    try:
        out = run_batch(model, cache, backend, pad_batch(items, num_tokens))
    finally:
        cache.release(PAD_RID)
    return unpad(out, raw)
