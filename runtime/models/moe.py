"""DeepSeek-V3 mixture of experts: noaux_tc grouped top-k routing, routed and shared experts.

Routing of one token (`route`, transformers' ``DeepseekV3TopkRouter`` op for op, in fp32):

    scores  = sigmoid(W_gate x)                         [experts]
    choice  = scores + e_score_correction_bias          the bias steers selection only
    groups  = sum of the top 2 choices in each of n_group groups; keep the topk_group best
    experts = top num_experts_per_tok choices among the kept groups' experts
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

The layer's output is ``sum_e weight_e * expert_e(x) + shared_experts(x)``. Experts run over the
tokens routed to them, in ascending expert order (as transformers adds them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.runtime.config import MoEConfig
from specmesh.runtime.models.layers import MLP
from specmesh.runtime.parallel import SINGLE, TensorParallel


def route(
    logits: torch.Tensor,  # [num_tokens, experts] fp32
    bias: torch.Tensor,  # [experts] fp32, e_score_correction_bias
    moe: MoEConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[num_tokens, top_k]`` fp32, expert ids ``[num_tokens, top_k]``)."""
    n, num_experts = logits.shape
    per_group = num_experts // moe.n_group
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(n, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [num_tokens, groups]
    expert_mask = group_mask[:, :, None].expand(n, moe.n_group, per_group).reshape(n, -1)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class MoEGate(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, hidden_size))
        # fp32 whatever the model's dtype (`DeepseekV3CausalLM.reset_fp32_buffers`)
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [num_tokens, experts]
        return route(logits, self.e_score_correction_bias.float(), self.moe)


class MoE(nn.Module):
    """With tensor parallelism every expert holds its slice of the intermediate size
    (`runtime.parallel`): each rank sums its partial outputs, and one all-reduce adds them."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = MoEGate(hidden_size, moe)
        inter = moe.moe_intermediate_size // tp.world_size
        self.experts = nn.ModuleList(MLP(hidden_size, inter) for _ in range(moe.n_routed_experts))
        self.has_shared = moe.n_shared_experts > 0
        if self.has_shared:
            self.shared_experts = MLP(hidden_size, inter * moe.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = self.gate(x)  # [num_tokens, top_k]
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # ascending
            tokens, slot = torch.where(ids == e)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.has_shared:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
