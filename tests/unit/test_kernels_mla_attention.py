"""Multi-head latent attention: the Triton kernel against the torch reference under the
interpreter (decode, ragged causal extend, tree verify with a custom mask), the DeepSeek-V3
widths and the tiny model's on one code path, V read in place as a view of K."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from paged_batch import assert_close_to_fp64, paged_batch

from specmesh.kernels.mla_attention import mla_attention, mla_attention_triton, v_is_k_latent
from specmesh.kernels.testing import kernel_devices
from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.attention.torch_backend import TorchBackend
from specmesh.runtime.attention.triton_backend import TritonBackend
from specmesh.runtime.kv_cache import KVCache

DECODE = [(70, 1), (3, 1), (17, 1), (0, 1)]
RAGGED = [(5, 1), (0, 7), (40, 3), (33, 8)]  # decode, prefill, extend, verify-sized rows


def mla_batch(
    lens: list[tuple[int, int]],
    heads: int,
    latent: int,
    rope: int,
    dtype: torch.dtype,
    device: str,
    tree_mask: bool,
    shared_v: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """K ``[slots, 1, latent + rope]``; V a strided view of K's latent columns (the model's
    layout), or of another tensor's first columns (a V that is not K)."""
    q, k_pool, v_pool, meta = paged_batch(
        lens, heads, 1, latent + rope, dtype, device, tree_mask, seed=seed
    )
    v_pool = (k_pool if shared_v else v_pool)[..., :latent]
    assert v_pool.stride(0) == latent + rope and v_is_k_latent(k_pool, v_pool) == shared_v
    return q, k_pool, v_pool, meta


CASES = {
    # lens, heads, kv_lora_rank, qk_rope_head_dim, tree mask
    "decode": (DECODE, 4, 32, 8, False),  # the tiny DeepSeek widths
    "extend": (RAGGED, 20, 32, 8, False),  # two head blocks, the second partial
    "verify": (RAGGED, 4, 32, 8, True),
    "odd_widths": (RAGGED, 3, 40, 12, True),  # neither part a power of two
    "v3_decode": ([(50, 1), (9, 1)], 16, 512, 64, False),  # DeepSeek-V3: 512 + 64
    "v3_verify": ([(20, 6), (0, 3)], 16, 512, 64, True),
}


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("shared_v", [True, False], ids=["v_in_k", "v_apart"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference_fp32(device: str, shared_v: bool, case: str) -> None:
    lens, heads, latent, rope, tree_mask = CASES[case]
    q, k_pool, v_pool, meta = mla_batch(lens, heads, latent, rope, torch.float32, device,
                                        tree_mask, shared_v, seed=len(case))  # fmt: skip
    out = mla_attention(q, k_pool, v_pool, meta, 0.3, impl="triton")
    assert out.shape == (q.shape[0], heads, latent)
    assert_close_to_fp64(out, q, k_pool, v_pool, meta, 0.3)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("tree_mask", [False, True])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_matches_reference(device: str, tree_mask: bool, num_splits: int) -> None:
    """Flash-decoding: each row's kv cut into pieces (empty ones included) and merged."""
    q, k_pool, v_pool, meta = mla_batch(RAGGED, 20, 32, 8, torch.float32, device, tree_mask,
                                        seed=num_splits)  # fmt: skip
    out = mla_attention_triton(q, k_pool, v_pool, meta, 0.3, num_splits=num_splits)
    assert_close_to_fp64(out, q, k_pool, v_pool, meta, 0.3)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(device: str, dtype: torch.dtype) -> None:
    """Products in the half type with fp32 accumulation: within the half type's rounding."""
    q, k_pool, v_pool, meta = mla_batch(RAGGED, 4, 32, 8, dtype, device, True)
    ref = mla_attention(q, k_pool, v_pool, meta, 0.25, impl="torch")
    out = mla_attention(q, k_pool, v_pool, meta, 0.25, impl="triton")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tree_mask", [False, True])
def test_reference_matches_torch_backend(tree_mask: bool) -> None:
    """The reference the kernel is held to is the torch backend's MLA path (V narrower)."""
    q, k_pool, v_pool, meta = mla_batch(RAGGED, 4, 32, 8, torch.float32, "cpu", tree_mask)
    backend = TorchBackend()
    backend.prepare(meta)
    expected = backend.forward(q, q, q, k_pool, v_pool, 0.5)
    ref = mla_attention(q, k_pool, v_pool, meta, 0.5, impl="torch")
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", kernel_devices())
def test_triton_backend_serves_the_latent_cache_sync_free(device: str) -> None:
    """`KVCache(latent_dim=...)`'s pools (V a view of K) through `TritonBackend` with no CPU
    metadata: the MLA kernel reads V in place (no copy of the pool) and equals the torch path."""
    cache = KVCache(num_layers=1, num_slots=200, num_kv_heads=1, head_dim=40,
                    dtype=torch.float32, device=device, latent_dim=32)  # fmt: skip
    pool = cache.pools[0]
    assert v_is_k_latent(pool.k, pool.v)
    q, k_rand, _, meta = mla_batch(RAGGED, 4, 32, 8, torch.float32, device, True)
    pool.k[: k_rand.shape[0]] = k_rand
    assert meta.q_lens_cpu is None and meta.max_q_len is None  # the sync-free path
    backend = TritonBackend()
    backend.prepare(meta)
    out = backend.forward(q, q[:, :1], q[:, :1, :32], pool.k, pool.v, 0.5)
    assert_close_to_fp64(out, q, pool.k, pool.v, meta, 0.5)


def test_refuses_shapes_it_does_not_run() -> None:
    q, k_pool, v_pool, meta = paged_batch([(3, 1)], 4, 2, 40, torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="one kv head"):
        mla_attention_triton(q, k_pool, v_pool[..., :32], meta, 0.5)
    with pytest.raises(ValueError, match="V narrower than K"):
        mla_attention_triton(q, k_pool[:, :1], v_pool[:, :1], meta, 0.5)
