"""`runtime.models.moe.MoE`'s dense path (every expert on every token, the path a CUDA graph
captures) against its routed path, on a tiny MoE in fp32: V3 and V2 routing, tokens sharing
experts, an expert no token picks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specmesh.runtime.config import MoEConfig
from specmesh.runtime.models.moe import MoE, dense_experts

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
