"""Attention backend on FlashInfer's paged-KV wrappers (GPU only; ``flashinfer`` is imported lazily).

Our KV pools are ``[num_slots, kv_heads, head_dim]`` per layer, i.e. FlashInfer's NHD paged layout
with ``page_size = 1`` once viewed as ``[num_slots, 1, kv_heads, head_dim]``: a page id is a slot
id, so our ragged metadata converts directly (int32, as FlashInfer wants):

    ours                                  FlashInfer
    qo_indptr                             qo_indptr                 (prefill wrapper only)
    kv_indptr / kv_indices                paged_kv_indptr / paged_kv_indices
    (page_size 1)                         paged_kv_last_page_len = 1 for every request
    custom_mask None                      causal=True (bottom-right aligned, like ours)
    custom_mask [sum q_len * kv_len]      custom_mask=..., causal=False (packed by plan)

Batches of one causal query row per request (decode) use ``BatchDecodeWithPagedKVCacheWrapper``,
everything else (extend, tree verify, tree draft decode) ``BatchPrefillWithPagedKVCacheWrapper``.
``plan`` runs once per batch on the host (so the backend needs the CPU lengths; FlashInfer's plan
reads host indptrs anyway) and ``run`` once per layer. The heads / head_dim / scale / dtypes that
``plan`` needs are learned at the first ``forward`` and cached; until then planning waits for the
first layer (which is why a graph runner runs warm-up forwards before it captures).

CUDA graphs: one ``use_cuda_graph=True`` wrapper per captured batch size, reading fixed int32
buffers that ``plan`` refills before each replay (`prepare_for_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specmesh.runtime.attention.base import AttentionBackend, AttentionMetadata

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class PlanInputs:
    """One batch's metadata in FlashInfer's terms (page size 1)."""

    decode: bool  # one causal row per request: the decode wrapper
    # The indptrs and last-page lengths are on the host, or on the mask's device with a mask.
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [sum kv_len] int32, device
    kv_last_page_len: torch.Tensor  # [bs] int32 ones
    custom_mask: torch.Tensor | None  # [sum q_len * kv_len] bool, device; None = causal


def plan_inputs(meta: AttentionMetadata) -> PlanInputs:
    if meta.q_lens_cpu is None or meta.kv_lens_cpu is None:
        raise ValueError(
            "the flashinfer backend plans on the host and needs q_lens_cpu / kv_lens_cpu"
        )
    q_lens, kv_lens = meta.q_lens_cpu, meta.kv_lens_cpu
    kv_total = sum(kv_lens)
    mask = None
    if meta.custom_mask is not None:  # a static buffer may be longer: pass the used part only
        mask = meta.custom_mask[: sum(q * k for q, k in zip(q_lens, kv_lens, strict=True))]
    # FlashInfer packs a custom mask into bits on the mask's device, reading the indptrs there.
    dev = "cpu" if mask is None else mask.device
    return PlanInputs(
        decode=mask is None and all(q == 1 for q in q_lens),
        qo_indptr=_indptr(q_lens).to(dev),
        kv_indptr=_indptr(kv_lens).to(dev),
        kv_indices=meta.kv_indices[:kv_total].to(torch.int32),
        kv_last_page_len=torch.ones(len(kv_lens), dtype=torch.int32, device=dev),
        custom_mask=mask,
    )


def _indptr(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out


@dataclass(frozen=True)
class _Dims:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


def decode_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """FlashInfer's CUDA-core decode kernels take query groups of 1, 2, 3, 4 or 8 heads per KV
    head; wider groups (and any other size) run on the tensor-core (prefill) kernels."""
    return num_qo_heads // num_kv_heads > 4


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    needs_cpu_metadata = True  # plan() works from host-side lengths
    SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    # fa2: the prefill kernels that take a custom mask (fa3, which "auto" picks on Hopper for a
    # causal first plan, takes none, and a wrapper keeps the kernels of its first plan).
    PREFILL_KERNELS = "fa2"

    def __init__(self, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        self.workspace_bytes = workspace_bytes
        self.workspace: torch.Tensor | None = None
        self.dims: _Dims | None = None
        self.wrappers: dict[str, Any] = {}  # "decode" / "prefill": eager wrappers
        # (runner's kv_indices buffer, batch size) -> use_cuda_graph wrapper: several runners
        # (decode and verify, one per MTP layer) share this backend and capture equal sizes.
        self.graph_wrappers: dict[tuple[int, int], Any] = {}
        self.graph_max_bs = 0
        self.capturing_bs: int | None = None
        self.wrapper: Any = None  # planned for the current batch
        self.plan: PlanInputs | None = None  # waiting for the first forward's dims
        self.pick: Any = None  # () -> the wrapper for the current batch, once dims are known

    # -- per batch -------------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.plan = plan_inputs(meta)
        kind = "decode" if self.plan.decode else "prefill"
        self.pick = lambda: self._eager_wrapper(kind, meta)
        self._plan_if_ready()

    def forward(self, q, k, v, k_pool, v_pool, scale):
        if q.dtype not in self.SUPPORTED_DTYPES or k_pool.dtype not in self.SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer backend runs fp16 / bf16 models, got {q.dtype} queries and a "
                f"{k_pool.dtype} KV cache: use --dtype bf16, or the triton backend"
            )
        dims = _Dims(q.shape[1], k_pool.shape[1], q.shape[2], float(scale), q.dtype, k_pool.dtype)
        if self.dims is None:
            self.dims = dims
        elif dims != self.dims:
            raise ValueError(f"flashinfer backend planned for {self.dims}, a layer has {dims}")
        self._plan_if_ready()
        paged = (k_pool.unsqueeze(1), v_pool.unsqueeze(1))  # [num_slots, 1, kv_heads, head_dim]
        return self.wrapper.run(q, paged)

    def _plan_if_ready(self) -> None:
        if self.plan is None or self.dims is None:
            return
        p, d = self.plan, self.dims
        self.wrapper = self.pick()
        common = dict(q_data_type=d.q_dtype, kv_data_type=d.kv_dtype, sm_scale=d.scale)
        if p.decode:
            self.wrapper.plan(
                p.kv_indptr, p.kv_indices, p.kv_last_page_len,
                d.num_qo_heads, d.num_kv_heads, d.head_dim, 1, **common,
            )  # fmt: skip
        else:
            self.wrapper.plan(
                p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len,
                d.num_qo_heads, d.num_kv_heads, d.head_dim, 1,
                custom_mask=p.custom_mask, causal=p.custom_mask is None, **common,
            )  # fmt: skip
        self.plan = None

    def _flashinfer(self):
        import flashinfer  # GPU-only dependency, imported where it is used

        return flashinfer

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self.workspace is None:
            self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        return self.workspace

    def _eager_wrapper(self, kind: str, meta: AttentionMetadata) -> Any:
        if kind not in self.wrappers:
            fi, ws = self._flashinfer(), self._workspace(meta.kv_indices.device)
            if kind == "decode":
                self.wrappers[kind] = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=self._tensor_cores()
                )
            else:
                self.wrappers[kind] = fi.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", backend=self.PREFILL_KERNELS
                )
        return self.wrappers[kind]

    def _tensor_cores(self) -> bool:
        assert self.dims is not None  # wrappers are built at the first plan, after a forward
        return decode_tensor_cores(self.dims.num_qo_heads, self.dims.num_kv_heads)

    # -- CUDA-graph hooks ------------------------------------------------------------------------
    def init_capture(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_max_bs = max(self.graph_max_bs, max_bs)

    def prepare_for_capture(self, bs: int, num_tokens: int) -> None:
        if bs > self.graph_max_bs:
            raise ValueError(f"flashinfer graph bucket bs={bs} exceeds max_bs={self.graph_max_bs}")
        self.capturing_bs = bs  # the wrapper is built at the next prepare_for_replay (needs meta)

    def prepare_for_replay(self, meta: AttentionMetadata, bs: int) -> None:
        if meta.batch_size != bs:
            raise ValueError(
                f"flashinfer graph replay for bs={bs} got metadata of {meta.batch_size}"
            )
        self.meta = meta
        self.plan = plan_inputs(meta)
        key = (meta.kv_indices.data_ptr(), bs)
        if key not in self.graph_wrappers and self.capturing_bs != bs:
            raise ValueError(f"flashinfer: no graph wrapper for bs={bs}; capture it first")
        decode = self.plan.decode
        self.pick = lambda: (
            self.graph_wrappers.get(key)
            or self.graph_wrappers.setdefault(key, self._graph_wrapper(meta, bs, decode))
        )
        self._plan_if_ready()

    def _graph_wrapper(self, meta: AttentionMetadata, bs: int, decode: bool) -> Any:
        """A fixed-batch-size wrapper over its own int32 buffers, sized by the runner's static
        metadata (``meta.kv_indices`` / ``meta.custom_mask`` are its upper-bound buffers)."""
        fi, dev = self._flashinfer(), meta.kv_indices.device
        ints = dict(dtype=torch.int32, device=dev)
        kv_indptr, last = torch.zeros(bs + 1, **ints), torch.ones(bs, **ints)
        kv_indices = torch.zeros(meta.kv_indices.numel(), **ints)
        ws = self._workspace(dev)
        if decode:
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores(),
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last,
            )  # fmt: skip
        mask = mask_indptr = None
        if meta.custom_mask is not None:  # bit-packed, each request padded to whole bytes
            mask = torch.zeros(meta.custom_mask.numel() // 8 + bs, dtype=torch.uint8, device=dev)
            mask_indptr = torch.zeros(bs + 1, **ints)
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(bs + 1, **ints),
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last, custom_mask_buf=mask, mask_indptr_buf=mask_indptr,
            backend=self.PREFILL_KERNELS,
        )  # fmt: skip
