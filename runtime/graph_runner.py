"""Static-shape forwards of fixed-width batches: CUDA graphs on a GPU, the same path eagerly on CPU.

One `GraphRunner` serves one mode (`GraphSizes`: target decode, target verify or a draft decode
step), in which every request has exactly ``tokens_per_req`` query rows. Batches are padded up to
a captured batch size (`capture_batch_sizes`) and written into one set of static buffers
(`GraphBuffers`) that the captured graph reads:

    run(items):  can_run(items)                 same width, no embeddings, bs <= max_bs
                 bs = bucket_size(len(items))   the smallest captured batch size that holds them
                 fill buffers (below)            reserve KV; ids, positions, indptrs: one copy
                 replay graph[bs]               (eager-static: call the model on the buffers)
                 unpad(output, raw_num_tokens)  EVERY output field cut back (invariant 2)

Buffer layout for a bucket of ``bs`` requests, ``raw_bs`` of them real (q = tokens_per_req):

    rows       [ real request rows (raw_bs * q) | padding rows ((bs - raw_bs) * q) | unused ]
    kv_indices [ real kv slots (sum kv_len)     | pad_slot x (bs - raw_bs) * q    | stale  ]
    out_slots  [ real new-token slots           | pad_slot ...                   ]
    mask       [ real tree masks                | lower-triangular [q, q] each   | stale  ]

Padding requests are whole requests of ``q`` rows whose K/V all go to ``pad_slot`` (the cache's
scratch slot, which no request owns), and which see only ``pad_slot``: they
read and write nothing a real request owns, so they cannot corrupt real KV (capture runs a batch
of padding requests only). Stale entries past the last indptr are never read. The ids, positions and
indptrs (`GraphBuffers.header`) are computed on the host for the whole bucket, padding included,
and written with the KV slots' table indices in one copy; the slots are gathered into place
from the request-to-slot table, the masks are one more copy. The buffers are
sized by `GraphSizes` (the upper bounds ``max_bs * max_kv_per_req``, invariant 5); nothing on the
replay path reads a size back from the device (invariant 3).

Outputs of a CUDA-graph replay are views of the graph's static outputs: valid until the runner's
next call (every caller consumes them first: logits, gathers and feature selection copy).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import (
    BatchItem,
    ForwardModel,
    HostLayout,
    host_layout,
    reserve_tokens,
)
from specmesh.runtime.models.layers import KVPair
from specmesh.runtime.static_shapes import GraphBuffers, GraphSizes, Selectable, bucket_size, unpad

T = TypeVar("T")

MODES = ("cuda-graph", "eager-static")


GRAPH_BACKENDS = ("triton", "flashinfer")  # the backends with graph hooks


def capture_graph(fn: Callable[[], T], pool: object) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` captured into a CUDA graph in memory ``pool`` (None: a new one), after two runs on
    a side stream: lazy initialisation and autotuning stay out of the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def graphs_enabled(cuda_graph: bool, device: str | torch.device, attention_backend: str) -> bool:
    """CUDA graphs run only on a CUDA device, when not disabled (``--disable-cuda-graph``), with a
    backend that keeps its metadata static; everything else runs eagerly. Never on CPU."""
    return (
        cuda_graph and torch.device(device).type == "cuda" and attention_backend in GRAPH_BACKENDS
    )


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (which is always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return sorted({*small, *range(16, max_bs, 8), max_bs})


class RowTuple(tuple):
    """A forward's tuple of per-row tensors (draft networks return ``(hidden, logits)``), with the
    same ``select`` as `ModelOutput`, so `unpad` cuts every element."""

    def select(self, index: torch.Tensor | slice) -> RowTuple:
        return RowTuple(t[index] if isinstance(t, torch.Tensor) else t for t in self)


def as_rows(out: object) -> Selectable:
    return RowTuple(out) if isinstance(out, tuple) else out  # type: ignore[return-value]


class GraphRunner:
    """Fixed-width batches through static buffers; see the module docstring for the layout."""

    def __init__(
        self,
        model: ForwardModel,
        cache: KVCache,
        backend: AttentionBackend,
        sizes: GraphSizes,
        *,
        mode: str = "eager-static",
        kv_pools: list[KVPair] | None = None,
        hidden_in: tuple[int, torch.dtype] | None = None,  # draft networks: (hidden size, dtype)
        batch_sizes: list[int] | None = None,
        head: Callable[[Selectable], Selectable] | None = None,  # run on the forward's output
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"graph runner mode must be one of {MODES}, got {mode!r}")
        device = cache.req_to_slot.device
        if mode == "cuda-graph" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV cache is on {device}")
        self.model, self.cache, self.backend = model, cache, backend
        self.sizes, self.mode, self.head = sizes, mode, head
        self.kv_pools = kv_pools if kv_pools is not None else cache.pools
        self.batch_sizes = batch_sizes or capture_batch_sizes(sizes.max_bs)
        if max(self.batch_sizes) > sizes.max_bs:
            raise ValueError(f"batch sizes {self.batch_sizes} exceed max_bs {sizes.max_bs}")
        self.pad_slot = cache.scratch_slot  # owned by no request (module docstring)
        self.buffers = GraphBuffers.allocate(sizes, device, self.pad_slot, hidden_in)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Selectable] = {}
        self.uses_graph_hooks = self._init_hooks()

    def _init_hooks(self) -> bool:
        """Backends that support CUDA graphs keep their metadata static through the hooks; the
        eager-static path falls back to ``prepare`` for the others (the torch backend)."""
        try:
            self.backend.init_capture(self.sizes.max_bs, self.sizes.max_num_tokens)
        except NotImplementedError:
            if self.mode == "cuda-graph":
                raise ValueError(
                    f"attention backend {self.backend.name!r} does not support CUDA graphs; "
                    "use triton or flashinfer, or --disable-cuda-graph"
                ) from None
            return False
        return True

    # -- ask -----------------------------------------------------------------------------------
    def can_run(self, items: list[BatchItem], hidden_in: torch.Tensor | None = None) -> bool:
        q = self.sizes.tokens_per_req
        return (
            self.fits(len(items), hidden_in)
            and all(it.q_len == q and it.input_embeds is None for it in items)
            and (self.sizes.has_mask or all(it.mask is None for it in items))
        )

    def fits(self, bs: int, hidden_in: torch.Tensor | None = None) -> bool:
        """Whether a batch of ``bs`` requests of ``tokens_per_req`` rows each (and this input
        hidden) can run: captured (or eager-static), within the largest bucket."""
        q, buf = self.sizes.tokens_per_req, self.buffers
        return (
            0 < bs <= max(self.batch_sizes)
            and (self.mode == "eager-static" or bool(self.graphs))
            and (hidden_in is None) == (buf.hidden_in is None)
            and (hidden_in is None or hidden_in.shape == (bs * q, buf.hidden_in.shape[1]))
        )

    # -- act -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, items: list[BatchItem], hidden_in: torch.Tensor | None = None) -> Selectable:
        """Forward ``items`` (``can_run`` must hold); outputs have ``len(items) * q`` rows."""
        if not self.can_run(items, hidden_in):
            raise ValueError(
                f"{self.sizes.mode} graph cannot run this batch: {len(items)} requests of "
                f"{sorted({it.q_len for it in items})} rows (needs <= {max(self.batch_sizes)} "
                f"requests of {self.sizes.tokens_per_req}, no input embeddings)"
            )
        bs = bucket_size(len(items), self.batch_sizes)
        meta = self._fill(items, hidden_in, bs)
        return self.replay(meta, bs, len(items) * self.sizes.tokens_per_req)

    def replay(self, meta: AttentionMetadata, bs: int, num_rows: int) -> Selectable:
        """Forward bucket ``bs`` over the buffers as filled (by `run`, or by a caller that
        fills them itself, as a draft search's steps do), cut back to ``num_rows`` rows."""
        if self.mode == "cuda-graph":
            self.backend.prepare_for_replay(meta, bs)
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self.forward_static(meta, bs)
        return unpad(out, num_rows)

    def forward_static(self, meta: AttentionMetadata, bs: int) -> Selectable:
        """Forward bucket ``bs`` over the buffers eagerly: what its graph replays, for a caller
        that captures several runners' forwards in one graph of its own (a draft search)."""
        self._prepare(meta, bs)
        return self._forward(bs)

    def pad_batch(self, bs: int) -> AttentionMetadata:
        """Fill the buffers with a batch of ``bs`` padding requests (as `capture` does)."""
        return self._fill([], None, bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm-up before the service reports ready: per batch size (largest first), a batch of
        padding requests only. CUDA: captured into one graph each, sharing a memory pool.
        Eager-static: the same hooks and forward, run once (nothing is kept)."""
        self.graphs.clear()
        self.outputs.clear()
        pool = torch.cuda.graph_pool_handle() if self.mode == "cuda-graph" else None
        for bs in sorted(self.batch_sizes, reverse=True):
            meta = self._fill([], None, bs)
            if self.uses_graph_hooks:
                self.backend.prepare_for_capture(bs, bs * self.sizes.tokens_per_req)
            self._prepare(meta, bs)
            if self.mode == "eager-static":
                self._forward(bs)
                continue
            self.graphs[bs], self.outputs[bs] = capture_graph(partial(self._forward, bs), pool)
            pool = self.graphs[bs].pool()

    def _prepare(self, meta: AttentionMetadata, bs: int) -> None:
        if self.uses_graph_hooks:
            self.backend.prepare_for_replay(meta, bs)
        else:
            self.backend.prepare(meta)

    def _forward(self, bs: int) -> Selectable:
        n, buf = bs * self.sizes.tokens_per_req, self.buffers
        extra = {} if buf.hidden_in is None else {"hidden_in": buf.hidden_in[:n]}
        out = self.model(
            positions=buf.positions[:n],
            kv_pools=self.kv_pools,
            backend=self.backend,
            input_ids=buf.input_ids[:n],
            **extra,
        )
        return as_rows(out if self.head is None else self.head(out))

    def _fill(
        self, items: list[BatchItem], hidden_in: torch.Tensor | None, bs: int
    ) -> AttentionMetadata:
        """Reserve the real requests' KV and write the padded batch into the static buffers:
        its integers computed on the host (`host_layout`, the padding's included) and copied
        to the device at once, the header straight from there, the KV slots gathered from the
        request-to-slot table into place."""
        q, buf = self.sizes.tokens_per_req, self.buffers
        raw_bs, num_pad = len(items), bs - len(items)
        raw = raw_bs * q
        kv_lens = [it.start + q for it in items]  # host-side: no device sync
        kv_raw = sum(kv_lens)
        mask_raw = kv_raw * q if self.sizes.has_mask else 0
        pad_mask = num_pad * q * q if self.sizes.has_mask else 0
        self.sizes.check(bs, kv_raw + num_pad * q, mask_raw + pad_mask)
        if items:
            reserve_tokens(self.cache, {it.rid: n for it, n in zip(items, kv_lens, strict=True)})
        lay = host_layout(self.cache, items, masks=self.sizes.has_mask)
        staged = torch.from_numpy(self._host_ints(lay, num_pad, kv_raw, mask_raw))
        staged = staged.to(buf.header.device)  # the one copy of the batch's integers
        head = buf.header.numel()
        buf.header.copy_(staged[:head])
        table = self.cache.req_to_slot.view(-1)
        torch.index_select(table, 0, staged[head : head + kv_raw], out=buf.kv_indices[:kv_raw])
        torch.index_select(table, 0, staged[head + kv_raw :], out=buf.out_slots[:raw])
        if lay.ids is None:  # ids already on the device
            buf.input_ids[:raw].copy_(torch.cat([it.input_ids for it in items]))
        if lay.mask is not None and mask_raw:
            buf.custom_mask[:mask_raw].copy_(torch.from_numpy(lay.mask))
        if hidden_in is not None:
            buf.hidden_in[:raw].copy_(hidden_in)
        if num_pad:
            self._pad_rows(raw_bs, num_pad, kv_raw, mask_raw)
        cpu = [*kv_lens, *[q] * num_pad] if self.backend.needs_cpu_metadata else None
        return buf.metadata(bs, q, cpu)

    def _host_ints(self, lay: HostLayout, num_pad: int, kv_raw: int, mask_raw: int) -> np.ndarray:
        """The header (`GraphBuffers.header`: ids, positions, kv and mask indptrs, the padding
        requests' included), then the table indices the KV slots are gathered from."""
        n, b, q = self.buffers.input_ids.numel(), self.sizes.max_bs + 1, self.sizes.tokens_per_req
        raw_bs = len(lay.kv_indptr) - 1
        raw = raw_bs * q
        head = np.zeros(2 * n + 2 * b, dtype=np.int64)  # padding rows: token 0 at position 0
        if lay.ids is not None:
            head[:raw] = lay.ids
        head[n : n + raw] = lay.positions
        steps = np.arange(1, num_pad + 1, dtype=np.int64) * q  # padding requests: q rows each
        kv = 2 * n
        head[kv : kv + raw_bs + 1] = lay.kv_indptr
        head[kv + raw_bs + 1 : kv + raw_bs + 1 + num_pad] = kv_raw + steps
        if lay.mask_indptr is not None:
            m = kv + b
            head[m : m + raw_bs + 1] = lay.mask_indptr
            head[m + raw_bs + 1 : m + raw_bs + 1 + num_pad] = mask_raw + steps * q
        return np.concatenate([head, lay.kv_at, lay.out_at])

    def fill_padding(self, raw_bs: int, num_pad: int, kv_raw: int, mask_raw: int) -> None:
        """Padding requests after the ``raw_bs`` real ones, for a caller that lays a batch out
        itself (a draft search): q rows each, their K/V in pad_slot, seeing only pad_slot. (A
        batch that fills its bucket has none: none of these ops runs, each a dispatch, and on
        a GPU a launch, in every draft step.)"""
        q, buf = self.sizes.tokens_per_req, self.buffers
        bs, raw = raw_bs + num_pad, raw_bs * q
        n = bs * q
        buf.kv_indptr[raw_bs + 1 : bs + 1].copy_(buf.pad_rows[:num_pad] + kv_raw)
        buf.input_ids[raw:n].zero_()
        buf.positions[raw:n].zero_()
        if buf.custom_mask is not None:
            buf.mask_indptr[raw_bs + 1 : bs + 1].copy_(buf.pad_rows[:num_pad] * q + mask_raw)
        self._pad_rows(raw_bs, num_pad, kv_raw, mask_raw)

    def _pad_rows(self, raw_bs: int, num_pad: int, kv_raw: int, mask_raw: int) -> None:
        """The padding requests' rows outside the header: K/V slots, input hidden, masks."""
        q, buf = self.sizes.tokens_per_req, self.buffers
        raw, n = raw_bs * q, (raw_bs + num_pad) * q
        buf.kv_indices[kv_raw : kv_raw + num_pad * q].fill_(self.pad_slot)
        buf.out_slots[raw:n].fill_(self.pad_slot)
        if buf.hidden_in is not None:
            buf.hidden_in[raw:n].zero_()
        if buf.custom_mask is not None:
            pad_mask = num_pad * q * q
            buf.custom_mask[mask_raw : mask_raw + pad_mask].copy_(buf.pad_mask[:pad_mask])
