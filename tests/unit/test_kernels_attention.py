"""Paged attention: the Triton kernel against the torch reference (and the torch backend)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from paged_batch import assert_close_to_fp64, paged_batch

from specmesh.kernels.attention import (
    TILES,
    default_num_splits,
    paged_attention,
    paged_attention_triton,
)
from specmesh.kernels.testing import kernel_devices
from specmesh.runtime.attention.torch_backend import TorchBackend
from specmesh.runtime.attention.triton_backend import TritonBackend

CASES = [
    # lens, heads, kv_heads, head_dim
    ([(0, 1)], 2, 2, 8),  # batch of 1, single token, no prefix
    ([(5, 1), (0, 7), (40, 3)], 4, 2, 16),  # ragged: decode, prefill, extend; GQA
    ([(70, 1), (3, 1), (17, 1)], 4, 1, 12),  # decode only, MQA, non-power-of-two head_dim
    ([(9, 6), (0, 1), (33, 8)], 6, 3, 128),  # large head_dim, group of 2
]


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("tree_mask", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_matches_reference_fp32(device: str, tiles: str, tree_mask: bool, case: int) -> None:
    lens, heads, kv_heads, head_dim = CASES[case]
    q, k_pool, v_pool, meta = paged_batch(
        lens, heads, kv_heads, head_dim, torch.float32, device, tree_mask, seed=case
    )
    out = paged_attention_triton(q, k_pool, v_pool, meta, 0.3, tiles=tiles)
    assert_close_to_fp64(out, q, k_pool, v_pool, meta, 0.3)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("tree_mask", [False, True])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_matches_reference(
    device: str, tiles: str, tree_mask: bool, num_splits: int
) -> None:
    """Flash-decoding: each row's kv cut into pieces merged afterwards, empty pieces included
    (the rows with fewer tiles than pieces)."""
    q, k_pool, v_pool, meta = paged_batch(
        [(0, 1), (70, 1), (21, 4)], 4, 2, 16, torch.float32, device, tree_mask, seed=num_splits
    )
    out = paged_attention_triton(q, k_pool, v_pool, meta, 0.3, num_splits=num_splits, tiles=tiles)
    assert_close_to_fp64(out, q, k_pool, v_pool, meta, 0.3)


def test_splits_fill_a_gpu_only_when_rows_are_few() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_num_splits(8, cuda) == 32  # batch 1 decode, 8 kv heads: cut each row
    assert default_num_splits(32 * 8, cuda) == 8
    assert default_num_splits(4096, cuda) == 1  # enough programs already
    assert default_num_splits(8, cpu) == 1  # the interpreter runs programs one by one


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(device: str, tiles: str, dtype: torch.dtype) -> None:
    q, k_pool, v_pool, meta = paged_batch([(6, 3), (0, 2)], 4, 2, 16, dtype, device, True)
    ref = paged_attention(q, k_pool, v_pool, meta, 0.25, impl="torch")
    out = paged_attention_triton(q, k_pool, v_pool, meta, 0.25, tiles=tiles)
    assert out.dtype == dtype
    # The reference computes in fp32; the fma tiles too (the final rounding to the half type
    # may differ by one ulp), the dot tiles round the probabilities to the half type first.
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tree_mask", [False, True])
def test_reference_matches_torch_backend(tree_mask: bool) -> None:
    q, k_pool, v_pool, meta = paged_batch([(4, 2), (0, 5), (11, 1)], 4, 2, 8, torch.float32, "cpu",
                                         tree_mask)  # fmt: skip
    backend = TorchBackend()
    backend.prepare(meta)
    expected = backend.forward(q, q, q, k_pool, v_pool, 0.5)
    ref = paged_attention(q, k_pool, v_pool, meta, 0.5, impl="torch")
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", kernel_devices())
def test_triton_backend_is_sync_free(device: str) -> None:
    q, k_pool, v_pool, meta = paged_batch([(3, 2), (8, 4)], 2, 1, 8, torch.float32, device, True)
    assert meta.q_lens_cpu is None and meta.max_q_len is None  # the sync-free path
    backend = TritonBackend()
    assert backend.name == "triton" and not backend.needs_cpu_metadata
    backend.prepare(meta)
    out = backend.forward(q, q[:, :1], q[:, :1], k_pool, v_pool, 0.5)
    assert_close_to_fp64(out, q, k_pool, v_pool, meta, 0.5)


def test_rows_per_program_follow_the_batch_shape() -> None:
    """A "rows" program takes a request's rows as the batch's shape says, from shapes alone."""
    from specmesh.kernels.attention import rows_per_program

    assert rows_per_program(32, 32, 4) == 1  # decode: one row per request
    assert rows_per_program(64, 8, 4) == 8  # a verify of 8-node trees, Llama-3-8B's group
    assert rows_per_program(60, 8, 4) == 8  # trees of 7 and 8 rows
    assert rows_per_program(64, 8, 16) == 4  # a large group: at most 64 query vectors
    assert rows_per_program(512, 1, 4) == 16  # a prefill chunk


def test_the_kernel_bench_times_every_tile_kind_and_split(tmp_path) -> None:
    """`bench.attention_speed`, a smoke run on CPU (the interpreter; no speed asserted): every
    tile kind at every asked split count, decode and verify shapes, in the JSON."""
    import json

    from specmesh.bench.attention_speed import main

    out = tmp_path / "attention.json"
    args = "--device cpu --dtype float32 --batch-sizes 2 --contexts 12 --layers 1 --heads 4"
    main([*args.split(), "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
          "--tree-rows", "4", "--num-splits", "0,2", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {(r["tiles"], r["num_splits"], r["q_rows"]) for r in rows} == {
        (t, s, q) for t in TILES for s in ("default", 2) for q in (1, 4)
    }
    assert all(r["step_us_median"] > 0 and r["kv_bytes"] == 2 * 24 * 2 * 16 * 4 for r in rows)
