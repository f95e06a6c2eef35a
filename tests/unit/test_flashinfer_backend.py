"""The FlashInfer backend's metadata conversion, on CPU through a fake ``flashinfer`` module: the
fake records every ``plan`` and implements ``run`` with our torch reference from the planned
(int32, page size 1) indptrs / indices / last-page lengths / mask / causal flag, so a wrong
conversion changes the outputs. The real library runs in the GPU test at the end."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from specmesh.kernels.attention import paged_attention_ref
from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.attention.flashinfer_backend import (
    FlashInferBackend,
    decode_tensor_cores,
    plan_inputs,
)
from specmesh.runtime.attention.torch_backend import TorchBackend, make_backend
from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, build_metadata, run_batch
from specmesh.runtime.models.causal_lm import load_causal_lm
from specmesh.runtime.static_shapes import decode_sizes, verify_sizes
from specmesh.target_service.verify import Tree


class _FakeWrapper:
    """Planned state, kept in the wrapper's own buffers in CUDA-graph mode like the real one."""

    plans: ClassVar[list[dict]] = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **buffers) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        if isinstance(self, FakePrefill):  # fa2: the masked prefill kernels
            assert buffers.pop("backend") == "fa2"
        else:  # the tiny model's 2 query heads per KV head run on CUDA cores
            assert buffers.pop("use_tensor_cores") is False
        self.use_cuda_graph, self.buffers = use_cuda_graph, buffers

    def _store(self, name: str, value: torch.Tensor | None) -> None:
        buf = self.buffers.get(name)
        if not self.use_cuda_graph or value is None:
            setattr(self, name, value)
            return
        assert buf is not None and value.numel() <= buf.numel(), f"{name} does not fit its buffer"
        buf[: value.numel()].copy_(value)
        setattr(self, name, buf[: value.numel()])

    def _run(self, q, paged_kv_cache, qo_indptr, mask, causal):
        k_cache, v_cache = paged_kv_cache  # [num_pages, page_size, kv_heads, head_dim]
        page_size = k_cache.shape[1]
        assert page_size == 1
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        kv_lens = (pages - 1) * page_size + self.last_page_len.cpu()
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        mask_lens = [q * k for q, k in zip(q_lens, kv_lens.tolist(), strict=True)]
        if mask is None and not causal:  # non-causal: every query row sees all of its kv
            mask = torch.ones(sum(mask_lens), dtype=torch.bool)
        meta = AttentionMetadata(
            qo_indptr=qo_indptr.long(), kv_indptr=self.kv_indptr.long(),
            kv_indices=self.kv_indices.long(), out_slots=torch.empty(0, dtype=torch.long),
            custom_mask=None if mask is None else mask.to(q.device),
            mask_indptr=None if mask is None else torch.tensor([0, *mask_lens]).cumsum(0),
        )  # fmt: skip
        return paged_attention_ref(q, k_cache[:, 0], v_cache[:, 0], meta, self.sm_scale)


class FakeDecode(_FakeWrapper):
    def plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw
    ):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        self.plans.append(dict(kind="decode", graph=self.use_cuda_graph, indptr=indptr.clone(),
                               last_page_len=last_page_len.clone(), page_size=page_size, **kw))  # fmt: skip
        self._store("paged_kv_indptr_buffer", indptr)
        self.kv_indptr = indptr.clone()
        self._store("paged_kv_indices_buffer", indices)
        self.kv_indices = self.paged_kv_indices_buffer
        self.last_page_len, self.sm_scale = last_page_len, kw["sm_scale"]

    def run(self, q, paged_kv_cache):
        return self._run(q, paged_kv_cache, torch.arange(len(self.last_page_len) + 1), None, True)


class FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask=None, causal=False, **kw):  # fmt: skip
        assert qo_indptr.dtype == paged_kv_indptr.dtype == paged_kv_indices.dtype == torch.int32
        self.plans.append(dict(kind="prefill", graph=self.use_cuda_graph, causal=causal,
                               mask=None if custom_mask is None else custom_mask.clone(),
                               last_page_len=paged_kv_last_page_len.clone(), page_size=page_size, **kw))  # fmt: skip
        if self.use_cuda_graph and custom_mask is not None:
            assert self.buffers["custom_mask_buf"] is not None, (
                "graph mask mode needs custom_mask_buf"
            )
        self.qo_indptr, self.kv_indptr = qo_indptr.clone(), paged_kv_indptr.clone()
        self._store("paged_kv_indices_buf", paged_kv_indices)
        self.kv_indices = self.paged_kv_indices_buf
        self.last_page_len, self.mask, self.causal = paged_kv_last_page_len, custom_mask, causal
        self.sm_scale = kw["sm_scale"]

    def run(self, q, paged_kv_cache):
        return self._run(q, paged_kv_cache, self.qo_indptr, self.mask, self.causal)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    # the real kernels run fp16 / bf16 only; the fake runs the fp32 reference
    monkeypatch.setattr(FlashInferBackend, "SUPPORTED_DTYPES", (torch.float32,))
    _FakeWrapper.plans = []
    return _FakeWrapper.plans


@pytest.fixture(scope="module")
def target(tiny_dir: Path):
    return load_causal_lm(tiny_dir / "target", dtype=torch.float32)


def _cache(model) -> KVCache:
    c = model.config
    return KVCache(
        num_layers=c.num_layers, num_slots=256, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=c.dtype, max_requests=8, max_context=32,
    )  # fmt: skip


def _batches(cache: KVCache) -> dict[str, list[BatchItem]]:
    lens = [5, 3, 7]
    for i in range(3):
        cache.add(f"r{i}")
    tree = Tree.from_parents(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))
    verify = []
    for i, n in enumerate(lens):
        mask = torch.cat([torch.ones(4, n + 2, dtype=torch.bool), tree.mask], dim=1)
        verify.append(BatchItem(f"r{i}", tree.tokens + i, n + 2, n + 2 + tree.depths, mask))
    return {
        "extend": [BatchItem(f"r{i}", torch.arange(3, 3 + n), 0) for i, n in enumerate(lens)],
        "chunked-extend": [
            BatchItem(f"r{i}", torch.tensor([30 + i, 31]), n) for i, n in enumerate(lens)
        ],
        "decode": [BatchItem(f"r{i}", torch.tensor([40 + i]), n + 2) for i, n in enumerate(lens)],
        "verify": verify,
    }


def test_flashinfer_matches_torch_on_every_mode(target, fake_flashinfer) -> None:
    """Extend, chunked extend (causal with a prefix), decode and tree verify, in sequence on one
    cache each: the same outputs as the torch backend, through the right wrapper and flags."""
    outs = {}
    for name, backend in [("torch", TorchBackend()), ("flashinfer", FlashInferBackend(1024))]:
        cache = _cache(target)
        outs[name] = [
            run_batch(target, cache, backend, items).hidden for items in _batches(cache).values()
        ]
    for want, got in zip(outs["torch"], outs["flashinfer"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # One plan per batch (not per layer), on the right wrapper with the right mask mode.
    kinds = [(p["kind"], p.get("causal"), p.get("mask") is not None) for p in fake_flashinfer]
    assert kinds == [("prefill", True, False), ("prefill", True, False), ("decode", None, False),
                     ("prefill", False, True)]  # fmt: skip
    for p in fake_flashinfer:
        assert p["page_size"] == 1 and torch.equal(
            p["last_page_len"], torch.ones(3, dtype=torch.int32)
        )
        assert p["q_data_type"] == torch.float32 and p["sm_scale"] == target.config.head_dim**-0.5
    assert make_backend("flashinfer").name == "flashinfer"


def test_plan_inputs_convert_our_metadata(target) -> None:
    cache = _cache(target)
    items = _batches(cache)["verify"]
    from specmesh.runtime.model_runner import reserve_batch

    reserve_batch(cache, items)
    meta = build_metadata(cache, items)
    p = plan_inputs(meta)
    assert p.qo_indptr.tolist() == [0, 4, 8, 12] and p.kv_indptr.tolist() == [0, 11, 20, 33]
    assert torch.equal(p.kv_indices, meta.kv_indices.int()) and not p.decode
    assert torch.equal(p.custom_mask, meta.custom_mask)
    with pytest.raises(ValueError, match="needs q_lens_cpu / kv_lens_cpu"):
        plan_inputs(build_metadata(cache, items, with_cpu=False))


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_flashinfer_graph_hooks_through_static_buffers(target, fake_flashinfer, mode: str) -> None:
    """The graph path (use_cuda_graph wrappers over fixed buffers, planned before each replay)
    on a padded batch equals the plain torch run."""
    cache = _cache(target)
    batches = _batches(cache)
    run_batch(target, cache, TorchBackend(), batches["extend"])
    run_batch(target, cache, TorchBackend(), batches["chunked-extend"])
    items = batches[mode]
    want = run_batch(target, cache, TorchBackend(), items).hidden
    backend = FlashInferBackend(1024)
    sizes = decode_sizes(8, 32) if mode == "decode" else verify_sizes(8, 4, 32)
    runner = GraphRunner(target, cache, backend, sizes, mode="eager-static")
    assert runner.uses_graph_hooks
    runner.capture()
    got = runner.run(items).hidden
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    graph_plans = [p for p in fake_flashinfer if p["graph"]]
    assert graph_plans and all(
        p["kind"] == ("decode" if mode == "decode" else "prefill") for p in graph_plans
    )
    assert len(backend.graph_wrappers) == len(runner.batch_sizes)


def test_flashinfer_limits_are_named() -> None:
    """Query groups the CUDA-core decode kernels lack go to tensor cores; fp32 is refused with
    the way out, before any kernel runs."""
    assert [decode_tensor_cores(q, 4) for q in (4, 8, 16, 28, 32, 64)] == [
        False, False, False, True, True, True,
    ]  # fmt: skip
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match=r"runs fp16 / bf16 models.*--dtype bf16"):
        FlashInferBackend().forward(q, q, q, q, q, 1.0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and the flashinfer package",
)
def test_real_flashinfer_matches_reference_on_gpu() -> None:
    """One backend through decode, causal extend and a tree mask, in that order (a prefill
    wrapper keeps the kernels of its first plan: they must take masks)."""
    torch.manual_seed(0)
    dev, heads, kv_heads, dim = "cuda", 8, 2, 64
    k_pool = torch.randn(64, kv_heads, dim, device=dev, dtype=torch.float16)
    v_pool = torch.randn_like(k_pool)
    lens = [5, 9, 12]
    kv_indices = torch.randperm(64, device=dev)[: sum(lens)]
    kv_indptr = torch.tensor([0, *lens], device=dev).cumsum(0)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    backend = FlashInferBackend()
    for q_lens, masked in [([1, 1, 1], False), ([2, 3, 4], False), ([3, 3, 3], True)]:
        mask = None
        if masked:
            mask = torch.cat(
                [
                    torch.cat([torch.ones(3, n - 3, dtype=torch.bool), tree], 1).flatten()
                    for n in lens
                ]
            ).to(dev)
        meta = AttentionMetadata(
            qo_indptr=torch.tensor([0, *q_lens], device=dev).cumsum(0), kv_indptr=kv_indptr,
            kv_indices=kv_indices, out_slots=kv_indices[:0], custom_mask=mask,
            mask_indptr=None if mask is None else torch.tensor([0, *[3 * n for n in lens]], device=dev).cumsum(0),
            q_lens_cpu=q_lens, kv_lens_cpu=lens, max_q_len=max(q_lens), max_kv_len=max(lens),
        )  # fmt: skip
        q = torch.randn(sum(q_lens), heads, dim, device=dev, dtype=torch.float16)
        backend.prepare(meta)
        got = backend.forward(q, None, None, k_pool, v_pool, dim**-0.5)
        want = paged_attention_ref(q, k_pool, v_pool, meta, dim**-0.5)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
