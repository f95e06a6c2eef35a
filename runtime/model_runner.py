"""Runs one forward over a ragged batch: reserves KV, builds attention metadata, calls the model.

A `BatchItem` says where a request's new tokens go (token index ``start`` of its KV row) and what
they may see (causal, or an explicit mask for tree verify / tree drafting). The runner knows
nothing about speculation; callers commit lengths afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
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
    positions: torch.Tensor | None = None  # [q_len] on the host; default start + arange(q_len)
    mask: torch.Tensor | None = None  # [q_len, start + q_len] bool on the host; None = causal
    input_embeds: torch.Tensor | None = None  # [q_len, hidden]; replaces the token embedding

    @property
    def q_len(self) -> int:
        return self.input_ids.numel()


class ForwardModel(Protocol):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, **kwargs: object) -> ModelOutput: ...


@dataclass
class DeviceBatch:
    """A ragged batch on the cache's device: its metadata, token ids and positions."""

    meta: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor


def build_metadata(
    cache: KVCache, items: list[BatchItem], *, with_cpu: bool = True
) -> AttentionMetadata:
    """Ragged metadata for ``items`` (`build_batch`'s)."""
    return build_batch(cache, items, with_cpu=with_cpu).meta


_NONE = np.zeros(0, dtype=np.int64)  # what an empty batch concatenates to
_NO_MASK = np.zeros(0, dtype=bool)


@dataclass
class HostLayout:
    """A ragged batch's integers, computed on the host (numpy): flat indices into the cache's
    request-to-slot table of every row's KV (``kv_at``) and of its new tokens' slots
    (``out_at``), the indptrs, positions, token ids (None when they are on the device) and
    the custom masks, flat and joined (None when no item has one), and where each begins."""

    kv_at: np.ndarray
    out_at: np.ndarray
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    positions: np.ndarray
    ids: np.ndarray | None
    mask: np.ndarray | None  # bool: what a batch's ``custom_mask`` holds
    mask_indptr: np.ndarray | None


def host_layout(cache: KVCache, items: list[BatchItem], *, masks: bool = False) -> HostLayout:
    """`HostLayout` of ``items``; ``masks``: every item's full mask (causal where it has
    none), else only when one has a mask."""
    q_lens = np.array([it.q_len for it in items], dtype=np.int64)
    starts = np.array([it.start for it in items], dtype=np.int64)
    table = cache.req_to_slot
    row = np.array([cache.get(it.rid).row for it in items], dtype=np.int64) * table.shape[1]
    qo_indptr, kv_indptr = _indptr(q_lens), _indptr(starts + q_lens)
    with_masks = masks or any(it.mask is not None for it in items)
    full = [_full_mask(it) for it in items] if with_masks else None
    if all(it.positions is None for it in items):  # start + arange(q_len) each, at once
        positions = _segments(starts, qo_indptr)
    else:
        positions = np.concatenate([_NONE, *(_positions(it) for it in items)])
    return HostLayout(
        _segments(row, kv_indptr),  # token indices 0 .. kv_len of each row
        _segments(row + starts, qo_indptr),
        qo_indptr,
        kv_indptr,
        positions,
        _host_ids(items),
        None if full is None else np.concatenate([_NO_MASK, *(m.ravel() for m in full)]),
        None if full is None else _indptr([m.size for m in full]),
    )


def build_batch(cache: KVCache, items: list[BatchItem], *, with_cpu: bool = True) -> DeviceBatch:
    """Ragged metadata, token ids and positions for ``items``. ``with_cpu=False`` leaves the
    metadata's CPU-side fields ``None``, as the sync-free GPU path does (invariant 3); backends
    that need them must cope. Every integer is computed on the host (`host_layout`) and copied
    to the device at once, where the slots are gathered from the request-to-slot table (ids
    already on the device, a draft step's, are joined there); a custom mask is one more copy."""
    lay = host_layout(cache, items)
    parts = [lay.kv_at, lay.out_at, lay.qo_indptr, lay.kv_indptr, lay.positions,
             _NONE if lay.ids is None else lay.ids]  # fmt: skip
    if lay.mask_indptr is not None:
        parts.append(lay.mask_indptr)
    table = cache.req_to_slot
    dev = table.device
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(dev)
    kv_at, out_at, qo, kv, positions, ids, *mask_indptr = flat.split([len(a) for a in parts])
    q_lens, kv_lens = [it.q_len for it in items], [it.start + it.q_len for it in items]
    meta = AttentionMetadata(
        qo_indptr=qo,
        kv_indptr=kv,
        kv_indices=table.view(-1)[kv_at],
        out_slots=table.view(-1)[out_at],
        custom_mask=None if lay.mask is None else torch.from_numpy(lay.mask).to(dev),
        mask_indptr=mask_indptr[0] if mask_indptr else None,
        q_lens_cpu=q_lens if with_cpu else None,
        kv_lens_cpu=kv_lens if with_cpu else None,
        max_q_len=max(q_lens) if with_cpu else None,
        max_kv_len=max(kv_lens) if with_cpu else None,
    )
    if lay.ids is None:
        ids = torch.cat([it.input_ids.to(dev) for it in items])
    return DeviceBatch(meta, ids, positions)


def _host_ids(items: list[BatchItem]) -> np.ndarray | None:
    """The items' token ids joined on the host, or None when any is on a device."""
    if not all(it.input_ids.device.type == "cpu" for it in items):
        return None
    if len(items) < 2:  # one request's own ids, or none: no join to dispatch
        return items[0].input_ids.numpy() if items else _NONE
    return torch.cat([it.input_ids for it in items]).numpy()  # one join, not one read each


def _positions(it: BatchItem) -> np.ndarray:
    if it.positions is not None:
        return it.positions.numpy()
    return np.arange(it.start, it.start + it.q_len, dtype=np.int64)


def _indptr(lens: list[int] | np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])


def _segments(first: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """``first[b] + arange(indptr[b + 1] - indptr[b])`` of every segment, concatenated."""
    return np.repeat(first - indptr[:-1], np.diff(indptr)) + np.arange(indptr[-1])


def _full_mask(it: BatchItem) -> np.ndarray:
    if it.mask is not None:  # a host tensor: a view, nothing copied
        return it.mask.numpy().astype(bool, copy=False)
    kv_len = it.start + it.q_len
    return np.arange(kv_len)[None, :] <= np.arange(it.q_len)[:, None] + it.start


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
    batch = build_batch(cache, items, with_cpu=backend.needs_cpu_metadata)
    backend.prepare(batch.meta)
    positions, input_ids = batch.positions, batch.input_ids
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
