"""Runs one forward over a ragged batch: reserves KV, builds attention metadata, calls the model.

A `BatchItem` says where a request's new tokens go (token index ``start`` of its KV row) and what
they may see (causal, or an explicit mask for tree verify / tree drafting). The runner knows
nothing about speculation; callers commit lengths afterwards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from specmesh.protocol.errors import KVCacheFullError
from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.models.causal_lm import ModelOutput
from specmesh.runtime.models.layers import KVPair


@dataclass
class BatchItem:
    rid: str
    input_ids: torch.Tensor  # [q_len] int64
    start: int  # token index of the first new token in the request's KV row
    positions: torch.Tensor | None = None  # [q_len]; default start + arange(q_len)
    mask: torch.Tensor | None = None  # [q_len, start + q_len] bool; None = causal
    input_embeds: torch.Tensor | None = None  # [q_len, hidden]; replaces the token embedding

    @property
    def q_len(self) -> int:
        return self.input_ids.numel()


class ForwardModel(Protocol):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, **kwargs: object) -> ModelOutput: ...


def build_metadata(
    cache: KVCache, items: list[BatchItem], *, with_cpu: bool = True
) -> AttentionMetadata:
    """Ragged metadata for ``items``. ``with_cpu=False`` leaves the CPU-side fields ``None``, as
    the sync-free GPU path does (invariant 3); backends that need them must cope. A few tensor
    ops for the whole batch, whatever its size (the per-request arithmetic is on host ints)."""
    q_lens = [it.q_len for it in items]
    kv_lens = [it.start + it.q_len for it in items]
    dev = cache.req_to_slot.device
    rows = [cache.get(it.rid).row for it in items]
    kv_indices = row_slots(cache, rows, [0] * len(items), kv_lens)
    out_slots = row_slots(cache, rows, [it.start for it in items], kv_lens)
    custom_mask = mask_indptr = None
    if any(it.mask is not None for it in items):
        masks = [_full_mask(it) for it in items]
        custom_mask = torch.cat([m.flatten() for m in masks]).to(dev)
        mask_indptr = indptr([m.numel() for m in masks], dev)
    return AttentionMetadata(
        qo_indptr=indptr(q_lens, dev),
        kv_indptr=indptr(kv_lens, dev),
        kv_indices=kv_indices,
        out_slots=out_slots,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        q_lens_cpu=q_lens if with_cpu else None,
        kv_lens_cpu=kv_lens if with_cpu else None,
        max_q_len=max(q_lens) if with_cpu else None,
        max_kv_len=max(kv_lens) if with_cpu else None,
    )


def row_slots(cache: KVCache, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
    """Slot ids of token indices ``starts[b]:ends[b]`` of table row ``rows[b]``, concatenated:
    one gather from the flat table (a plain slice for one request)."""
    table = cache.req_to_slot
    if len(rows) == 1:
        return table[rows[0], starts[0] : ends[0]]
    lens = torch.tensor([e - s for s, e in zip(starts, ends, strict=True)])
    # element i of segment b reads flat entry rows[b] * width + starts[b] + i
    first = torch.tensor([r * table.shape[1] + s for r, s in zip(rows, starts, strict=True)])
    seg_start = lens.cumsum(0) - lens
    flat = torch.arange(int(lens.sum())) + (first - seg_start).repeat_interleave(lens)
    return table.view(-1)[flat.to(table.device)]


def _full_mask(it: BatchItem) -> torch.Tensor:
    if it.mask is not None:
        return it.mask.bool()
    kv_len = it.start + it.q_len
    return torch.arange(kv_len)[None, :] <= torch.arange(it.q_len)[:, None] + it.start


def indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64).to(device)


def batch_positions(items: list[BatchItem]) -> torch.Tensor:
    """Every item's positions (default ``start + arange(q_len)``), concatenated."""
    if all(it.positions is None and it.q_len == 1 for it in items):  # decode: one tensor
        return torch.tensor([it.start for it in items], dtype=torch.int64)
    return torch.cat(
        [
            it.positions
            if it.positions is not None
            else torch.arange(it.start, it.start + it.q_len)
            for it in items
        ]
    )


def reserve_batch(cache: KVCache, items: list[BatchItem]) -> None:
    """`reserve_tokens` for every item's rows."""
    reserve_tokens(cache, {it.rid: it.start + it.q_len for it in items})


def reserve_tokens(cache: KVCache, demands: dict[str, int]) -> None:
    """Ask for every request's slots (rid -> tokens held) first, then take them: a batch that
    does not fit changes nothing and raises `KVCacheFullError`."""
    if not cache.can_allocate(demands):
        need = sum(cache.pages_needed(r, n) for r, n in demands.items()) * cache.page_size
        raise KVCacheFullError(f"batch needs {need} more KV slots, {cache.num_free_slots} free")
    cache.reserve_all(demands)


@torch.inference_mode()
def run_batch(
    model: ForwardModel,
    cache: KVCache,
    backend: AttentionBackend,
    items: list[BatchItem],
    kv_pools: list[KVPair] | None = None,
) -> ModelOutput:
    """Forward the new tokens of every item; outputs are flat rows in item order."""
    reserve_batch(cache, items)
    dev = cache.req_to_slot.device
    backend.prepare(build_metadata(cache, items, with_cpu=backend.needs_cpu_metadata))
    positions = batch_positions(items).to(dev)
    input_ids = torch.cat([it.input_ids for it in items]).to(dev)
    embeds = None
    if any(it.input_embeds is not None for it in items):
        embeds = torch.cat(
            [
                e if (e := it.input_embeds) is not None else model.embed(it.input_ids.to(dev))
                for it in items
            ]
        )
    return model(
        positions=positions,
        kv_pools=kv_pools if kv_pools is not None else cache.pools,
        backend=backend,
        input_ids=None if embeds is not None else input_ids,
        input_embeds=embeds,
    )
