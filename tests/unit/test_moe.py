"""`runtime.models.moe.MoE`'s dense path (every expert on every token, the path a CUDA graph
captures) against its routed path, on a tiny MoE in fp32: V3 and V2 routing, tokens sharing
experts, an expert no token picks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specmesh.kernels.moe_experts import routed_experts
from specmesh.kernels.testing import kernel_devices
from specmesh.runtime.config import MoEConfig
from specmesh.runtime.models.moe import MoE, dense_experts, stack_experts

V3 = {"scoring": "sigmoid", "topk_method": "noaux_tc"}
V2 = {"scoring": "softmax", "topk_method": "group_limited_greedy"}


def _moe(routing: dict[str, str], hidden: int = 16) -> MoE:
    cfg = MoEConfig(**routing, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                    topk_group=2, n_shared_experts=1, moe_intermediate_size=12,
                    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0)  # fmt: skip
    moe = MoE(hidden, cfg)
    torch.manual_seed(0)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.3)
    with torch.no_grad():  # with feature 0 at 5 (below), no token picks expert 7
        moe.gate.weight[:, 0] = 0.0
        moe.gate.weight[7, 0] = -20.0
    return moe.eval()


@pytest.mark.parametrize("routing", [V3, V2], ids=["v3", "v2"])
def test_dense_path_equals_routed_path(routing: dict[str, str]) -> None:
    moe = _moe(routing)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 5.0
    with torch.no_grad():
        _, ids = moe.gate(x)
        routed, dense = moe(x, dense=False), moe(x, dense=True)
        default = moe(x)
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert counts[:7].min() > 1 and counts[7] == 0, counts  # shared experts, one unused
    assert all(len(set(row)) == len(row) for row in ids.tolist())  # once per token
    assert not dense_experts(x)  # nothing is captured on CPU: the routed path by default
    assert torch.equal(default, routed)
    torch.testing.assert_close(dense, routed, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("routing", [V3, V2], ids=["v3", "v2"])
def test_stacked_pairs_equal_the_routed_path(routing: dict[str, str]) -> None:
    """With the experts stacked, a batch with fewer (token, expert) pairs than experts takes
    each pair on its own expert (a decode step's shape), a larger one every expert; both equal
    the routed path, and the experts' weights are views of the stacks (nothing held twice)."""
    moe = _moe(routing)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    stack_experts(moe)
    assert moe.w13.shape == (8, 24, 16) and moe.w2.shape == (8, 16, 12)
    for n, p in moe.named_parameters():  # the same values, now in the stacks
        assert torch.equal(p, before[n]), n
    assert moe.experts[3].up_proj.weight.data_ptr() == moe.w13[3, 12:].data_ptr()
    for tokens in (2, 32):  # 6 pairs (< 8 experts), 96 pairs
        x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            routed, dense = moe(x, dense=False), moe(x, dense=True)
        torch.testing.assert_close(dense, routed, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_kernels_equal_their_reference(device: str, dtype: torch.dtype) -> None:
    """The Triton pairs (gate/up per block of the intermediate size, down per block of the
    hidden size) against the torch reference: sizes not multiples of the blocks, tokens
    sharing an expert, the terms added in ascending expert order."""
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens, k = 6, 40, 36, 3, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype).to(device)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype).to(device)
    ids = torch.tensor([[4, 1], [1, 5], [0, 4]], device=device)
    weights = torch.rand(tokens, k, generator=gen).to(device)
    want = routed_experts(x, w13, w2, ids, weights, impl="torch")
    got = routed_experts(x, w13, w2, ids, weights, impl="triton")
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)


def test_fused_experts_stack_into_views_of_the_stacks() -> None:
    """Experts whose gate / up products were merged (`MLP.fuse`, CUDA's layout) stack too:
    each merged matrix becomes its expert's rows of `w13`, and the layer's output is kept."""
    moe = _moe(V3)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    x[:, 0] = 5.0
    with torch.no_grad():
        want = moe(x, dense=False)
        for expert in moe.experts:
            expert.fuse()
        stack_experts(moe)
        got = moe(x, dense=False), moe(x, dense=True)
    assert all(e.gate_up.data_ptr() == moe.w13[i].data_ptr() for i, e in enumerate(moe.experts))
    for out in got:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
