"""Training-time-test training of the EAGLE-3 draft against the frozen target, and its evals.

Alignment for a window x_0..x_{T-1} (R = T - 1 draft rows, K steps), with
`greedy[t]` = the target's argmax at position t (its prediction of x_{t+1}):

    row p, step j:  token x_{p+1+j} = step_tokens[p + j]     label greedy[p+1+j] = labels[p + j]

both padded by K - 1 columns (label -1 = no target, ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from specmesh.demo.eagle3 import Eagle3Draft

IGNORE = -100


def aux_hidden_indices(num_layers: int) -> list[int]:
    """`output_hidden_states` indices of the taps = inputs of layers [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(num_layers: int) -> list[int]:
    """The same taps in the config's output-of-layer convention: [1, L//2 - 1, L - 4]."""
    return [i - 1 for i in aux_hidden_indices(num_layers)]


@dataclass(frozen=True)
class TargetFeatures:
    aux_hidden: torch.Tensor  # [B, R, 3*Ht]
    step_tokens: torch.Tensor  # [B, R + K - 1] int64
    labels: torch.Tensor  # [B, R + K - 1] int64, target greedy ids, -1 = none


@torch.no_grad()
def target_features(
    target: LlamaForCausalLM, windows: torch.Tensor, num_steps: int, fast: bool
) -> TargetFeatures:
    """Run the frozen target over windows [B, T]; `fast` uses bf16 autocast."""
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=fast):
        out = target(input_ids=windows, output_hidden_states=True)
    taps = [out.hidden_states[i] for i in aux_hidden_indices(target.config.num_hidden_layers)]
    aux = torch.cat(taps, dim=-1)[:, :-1].float()  # [B, R, 3*Ht]
    greedy = out.logits.argmax(-1)  # [B, T]
    pad = (0, num_steps - 1)
    step_tokens = F.pad(windows[:, 1:], pad, value=target.config.pad_token_id)
    labels = F.pad(greedy[:, 1:], pad, value=-1)
    return TargetFeatures(aux, step_tokens, labels)


def step_labels(draft: Eagle3Draft, labels: torch.Tensor, step: int, num_rows: int):
    """(target ids [B, R], draft ids [B, R] with IGNORE where no target or not in the hot vocab)."""
    target_ids = labels[:, step : step + num_rows]
    valid = target_ids >= 0
    draft_ids = draft.to_draft_ids(target_ids.clamp(min=0), IGNORE)
    return target_ids, torch.where(valid, draft_ids, torch.full_like(draft_ids, IGNORE))


def ttt_loss(
    draft: Eagle3Draft,
    target: LlamaForCausalLM,
    windows: torch.Tensor,
    num_steps: int,
    decay: float,
) -> torch.Tensor:
    """sum_j decay^j * CE(step j, target greedy) / sum_j decay^j."""
    feats = target_features(target, windows, num_steps, fast=True)
    embed = target.model.embed_tokens.weight
    with torch.autocast(windows.device.type, dtype=torch.bfloat16):
        logits = draft(feats.aux_hidden, feats.step_tokens, embed, num_steps)
    num_rows = feats.aux_hidden.shape[1]
    total, weights = 0.0, 0.0
    for step, step_logits in enumerate(logits):
        _, draft_ids = step_labels(draft, feats.labels, step, num_rows)
        ce = F.cross_entropy(
            step_logits.float().flatten(0, 1), draft_ids.flatten(), ignore_index=IGNORE
        )
        total = total + decay**step * ce
        weights += decay**step
    return total / weights


@torch.no_grad()
def step_accuracy(
    draft: Eagle3Draft, target: LlamaForCausalLM, windows: torch.Tensor, num_steps: int
) -> list[float]:
    """Teacher-forced top-1 agreement with the target's greedy token, per step (fp32)."""
    draft.eval()
    hits, counts = [0] * num_steps, [0] * num_steps
    for chunk in windows.split(8):
        feats = target_features(target, chunk, num_steps, fast=False)
        embed = target.model.embed_tokens.weight
        logits = draft(feats.aux_hidden, feats.step_tokens, embed, num_steps)
        for step, step_logits in enumerate(logits):
            target_ids, _ = step_labels(draft, feats.labels, step, step_logits.shape[1])
            valid = target_ids >= 0
            predicted = draft.to_target_ids(step_logits.argmax(-1))
            hits[step] += int(((predicted == target_ids) & valid).sum())
            counts[step] += int(valid.sum())
    return [h / max(c, 1) for h, c in zip(hits, counts, strict=True)]


@torch.no_grad()
def greedy_continue(target: LlamaForCausalLM, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
    """Plain greedy decoding, no cache: [N, P] -> [N, P + num_new]."""
    sequences = prompts
    for _ in range(num_new):
        next_ids = target(input_ids=sequences).logits[:, -1].argmax(-1, keepdim=True)
        sequences = torch.cat([sequences, next_ids], dim=1)
    return sequences


@dataclass(frozen=True)
class ChainStats:
    conditional_acceptance: list[float]  # P(step j accepted | steps < j accepted)
    mean_accept_length: float  # tokens emitted per round = 1 + accepted drafts (chain, depth K)
    num_rounds: int


@torch.no_grad()
def chain_acceptance(
    draft: Eagle3Draft, target: LlamaForCausalLM, prompts: torch.Tensor, num_new: int, depth: int
) -> ChainStats:
    """Greedy chain speculation simulated on the target's own greedy continuations.

    Every generated position is a possible round start: the draft sees the target features of
    the (greedy) prefix, proposes `depth` tokens feeding back its own tokens, and the chain is
    accepted up to the first disagreement with the target's greedy tokens.
    """
    draft.eval()
    sequences = greedy_continue(target, prompts, num_new)  # [N, S]
    feats = target_features(target, sequences, depth, fast=False)
    embed = target.model.embed_tokens.weight
    logits = draft(feats.aux_hidden, feats.step_tokens, embed, depth, feed_drafted=True)
    num_rows = feats.aux_hidden.shape[1]
    first_row, last_row = prompts.shape[1] - 1, num_rows - depth  # root x_{p+1} is generated
    matches = []
    for step, step_logits in enumerate(logits):
        target_ids, _ = step_labels(draft, feats.labels, step, num_rows)
        predicted = draft.to_target_ids(step_logits.argmax(-1))
        matches.append((predicted == target_ids)[:, first_row : last_row + 1])
    chain = torch.stack(matches, dim=-1).long().cumprod(dim=-1)  # [N, rows, depth]
    reached = [chain.numel() // depth] + [int(chain[..., j].sum()) for j in range(depth)]
    conditional = [reached[j + 1] / max(reached[j], 1) for j in range(depth)]
    mean_accept = 1.0 + chain.sum(-1).float().mean().item()
    return ChainStats(conditional, mean_accept, chain.numel() // depth)
