"""DeepSeek mixture of experts: V3's noaux_tc grouped top-k routing (V2's softmax routing:
`_route_v2`), routed and shared experts.

Routing of one token (`route`, transformers' ``DeepseekV3TopkRouter`` op for op, in fp32):

    scores  = sigmoid(W_gate x)                         [experts]
    choice  = scores + e_score_correction_bias          the bias steers selection only
    groups  = sum of the top 2 choices in each of n_group groups; keep the topk_group best
    experts = top num_experts_per_tok choices among the kept groups' experts
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

The layer's output is ``sum_e weight_e * expert_e(x) + shared_experts(x)``. Experts run over the
tokens routed to them, in ascending expert order (as transformers adds them). While a CUDA graph is
captured (`dense_experts`), where the routed path's host syncs are not permitted, a layer whose
experts are stacked (`stack_experts`, done before capture) runs each (token, chosen expert) pair
on its own expert's weights when the pairs are fewer than the experts
(`kernels.moe_experts`: only the chosen experts are read); otherwise every expert runs on
every token, weighted 0 where the token did not pick it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.kernels.moe_experts import routed_experts
from specmesh.runtime.config import MoEConfig
from specmesh.runtime.models.layers import MLP
from specmesh.runtime.parallel import SINGLE, TensorParallel


def route(
    logits: torch.Tensor,  # [num_tokens, experts] fp32
    bias: torch.Tensor | None,  # [experts] fp32, e_score_correction_bias (V3 only)
    moe: MoEConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[num_tokens, top_k]`` fp32, expert ids ``[num_tokens, top_k]``)."""
    if moe.scoring == "softmax":
        weights, ids = _route_v2(logits, moe)
    else:
        weights, ids = _route_v3(logits, bias, moe)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _route_v3(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores; groups ranked by their top-2 biased scores; the bias steers only."""
    n, num_experts = logits.shape
    per_group = num_experts // moe.n_group
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    group_scores = choice.view(n, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [num_tokens, groups]
    expert_mask = group_mask[:, :, None].expand(n, moe.n_group, per_group).reshape(n, -1)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def _route_v2(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores; top-k of all experts, or of the ``topk_group`` groups with the highest
    single score (transformers' ``DeepseekV2TopkRouter``, op for op)."""
    n, num_experts = logits.shape
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if moe.topk_method == "group_limited_greedy":
        per_group = num_experts // moe.n_group
        group_scores = scores.view(n, moe.n_group, per_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask[:, :, None].expand(n, moe.n_group, per_group).reshape(n, -1)
        scores = scores.masked_fill(~expert_mask.bool(), 0.0)
    return torch.topk(scores, k=moe.num_experts_per_tok, dim=-1, sorted=False)


class MoEGate(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, hidden_size))
        # V3's routing bias, fp32 whatever the model's dtype (`routing_bias_to_fp32`); V2 has none
        bias = torch.zeros(moe.n_routed_experts) if moe.scoring == "sigmoid" else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [num_tokens, experts]
        bias = self.e_score_correction_bias
        return route(logits, None if bias is None else bias.float(), self.moe)


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
        # `stack`: every expert's [gate; up] rows [E, 2I, H] and down [E, H, I], the experts'
        # own weights views of them
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def stack(self) -> None:
        """Stack the experts' weights into `w13` / `w2`, each expert's a view of its rows (no
        memory kept twice; while stacking, one layer's experts are held twice)."""
        if self.w13 is not None:
            return
        first = self.experts[0]
        inter, hidden = first.down_proj.weight.shape[1], first.down_proj.weight.shape[0]
        like = first.down_proj.weight
        n = len(self.experts)
        w13 = torch.empty(n, 2 * inter, hidden, dtype=like.dtype, device=like.device)
        w2 = torch.empty(n, hidden, inter, dtype=like.dtype, device=like.device)
        with torch.no_grad():
            for e, expert in enumerate(self.experts):
                w13[e, :inter].copy_(expert.gate_proj.weight)
                w13[e, inter:].copy_(expert.up_proj.weight)
                w2[e].copy_(expert.down_proj.weight)
                expert.gate_proj.weight.data = w13[e, :inter]
                expert.up_proj.weight.data = w13[e, inter:]
                expert.down_proj.weight.data = w2[e]
                if expert.gate_up is not None:  # fused: [gate; up] is this expert's w13 rows
                    expert.gate_up = w13[e]
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
        """``x``: [num_tokens, hidden]. ``dense``: the sync-free path (None: `dense_experts`
        decides): each pair on its expert when stacked and the pairs are fewer than the
        experts, else every expert on every token."""
        weights, ids = self.gate(x)  # [num_tokens, top_k]
        if dense is None:
            dense = dense_experts(x)
        out = torch.zeros_like(x)
        if dense and self.w13 is not None and ids.numel() <= len(self.experts):
            impl = "triton" if x.is_cuda else "torch"  # each pair on its expert, no host sync
            out = routed_experts(x, self.w13, self.w2, ids, weights, impl)
        elif dense:  # the routed path's sum, term for term, without a host sync
            for e, expert in enumerate(self.experts):  # ascending, as below
                picked = ids == e  # [num_tokens, top_k]: a token picks an expert once at most
                w = torch.where(picked, weights, 0.0).sum(dim=-1, keepdim=True)
                y = torch.where(picked.any(dim=-1, keepdim=True), expert(x) * w, 0.0)
                out += y.to(out.dtype)  # a token that did not pick ``e`` adds 0
        else:
            for e in ids.unique().tolist():  # ascending
                tokens, slot = torch.where(ids == e)
                y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
                out.index_add_(0, tokens, y.to(out.dtype))
        if self.has_shared:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


def stack_experts(*modules: nn.Module) -> None:
    """`MoE.stack` every mixture of experts in ``modules`` (before a CUDA graph captures them)."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.stack()


def dense_experts(x: torch.Tensor) -> bool:
    """Whether `MoE` takes its sync-free path for ``x`` (each pair on its stacked expert, or
    every expert on every token): while a CUDA graph is captured, where the routed path's host
    syncs (``unique``, ``where``) are not permitted. Both add the routed path's terms in its
    order; only the products' shapes differ."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
