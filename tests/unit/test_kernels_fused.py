"""The fused decoder kernels (`kernels.fused`) against the unfused torch ops they replace: each
kernel alone, then whole models (Llama with GQA and aux captures, Qwen2 with q/k/v bias,
DeepSeek with MLA and MoE) forwarded both ways."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch.nn.functional as F
from conftest import reorder_tolerance

from specmesh.kernels.fused import add_rms_norm, rope_store, silu_mul
from specmesh.kernels.testing import kernel_devices
from specmesh.protocol.features import AuxLayers
from specmesh.runtime.attention.base import store_kv
from specmesh.runtime.attention.torch_backend import TorchBackend
from specmesh.runtime.config import RopeConfig
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import load_causal_lm
from specmesh.runtime.models.layers import Rotary

DTYPES = [torch.float32, torch.bfloat16]


def _spelled_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`'s op sequence off CPU (the one the kernel rounds like)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_matches_torch(device: str, dtype: torch.dtype, residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    total, out = add_rms_norm(x, w, 1e-5, r if residual else None)
    want_total = x + r if residual else x
    torch.testing.assert_close(total, want_total, **_tol(dtype))
    if device == "cuda":  # the sum rounds once, as torch's add does (the interpreter truncates)
        assert torch.equal(total, want_total)
    torch.testing.assert_close(out, _spelled_rms_norm(want_total, w, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_matches_rotary_and_store_kv(device: str, dtype: torch.dtype) -> None:
    """q / k / v as slices of one merged product (strided rows), GQA, permuted slots: the
    rotated q and k equal `Rotary`'s, and the pools equal `store_kv`'s, untouched slots too."""
    n, hq, hkv, dim = 4, 6, 2, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (hq + 2 * hkv) * dim, generator=g).to(device, dtype)
    q, k, v = (t.view(n, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], -1))
    rotary = Rotary(RopeConfig(theta=10000.0), dim).to(device)
    positions = torch.tensor([3, 0, 17, 9], device=device)
    slots = torch.tensor([7, 2, 11, 5], device=device)
    pools = [torch.randn(12, hkv, dim, generator=g).to(device, dtype) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q, want_k = rotary(q, k, positions)
    store_kv(want_k, v, *want_pools, slots)
    cos, signed_sin = rotary.cos_sin(positions, dtype)
    got_q, got_k = rope_store(q, k, v, cos, signed_sin, *pools, slots)
    tol = _tol(dtype)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    for got, want in zip(pools, want_pools, strict=True):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(device: str, dtype: torch.dtype) -> None:
    gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **_tol(dtype))


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: one reduction in another order; bf16: a last-bit tie may round the other way
    return reorder_tolerance(dtype) if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specmesh.runtime.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("qwen2") / "target", arch="qwen2")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("which", ["llama", "qwen2", "deepseek"])
def test_fused_model_equals_unfused(request, tiny_dir, which: str) -> None:
    """A prefill and a decode step through the fused and the unfused forward of one model:
    the normed and pre-norm hidden states, the aux captures and every KV written agree, and
    the fused weights are views of the parameters (the state dict is unchanged)."""
    model_dir = {"llama": tiny_dir / "target", "qwen2": None, "deepseek": None}[which]
    if model_dir is None:
        model_dir = request.getfixturevalue(
            f"{'qwen2' if which == 'qwen2' else 'tiny_deepseek'}_dir"
        )
    outs = []
    for fused in (False, True):
        model = load_causal_lm(model_dir)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if fused:
            model.fuse_kernels()
            for name, value in model.state_dict().items():
                assert torch.equal(value, before[name]), name
        model.set_aux_layers(AuxLayers((0, 1), "input"))
        mc = model.config
        cache = KVCache(num_layers=mc.num_layers, num_slots=32, num_kv_heads=model.num_local_kv_heads,
                        head_dim=mc.head_dim, dtype=torch.float32, latent_dim=mc.kv_latent_dim)  # fmt: skip
        cache.add("r")
        prompt = torch.tensor([5, 6, 7, 8, 9, 10, 11])
        first = run_batch(model, cache, TorchBackend(), [BatchItem("r", prompt, 0)])
        step = run_batch(model, cache, TorchBackend(), [BatchItem("r", torch.tensor([12]), 7)])
        outs.append((first, step, [(kv.k.clone(), kv.v.clone()) for kv in cache.pools]))
    tol = reorder_tolerance(torch.float32)
    for a, b in zip(outs[0][:2], outs[1][:2], strict=True):
        for field in ("hidden", "hidden_pre_norm", "aux_hidden"):
            torch.testing.assert_close(getattr(b, field), getattr(a, field), **tol)
    for (k0, v0), (k1, v1) in zip(outs[0][2], outs[1][2], strict=True):
        torch.testing.assert_close(k1, k0, **tol)
        torch.testing.assert_close(v1, v0, **tol)
