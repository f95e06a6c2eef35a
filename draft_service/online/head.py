"""The served head as it trains: the offline trainer's training-time test
(`specmesh.demo.draft_train`) on the serving module's own layers, for EAGLE-3 heads
(`Eagle3Head`) and EAGLE-1 heads (`Eagle1Head`: the same loss, the head's own forward).

A window of one request's rows ``x_0 .. x_{n-1}`` (tokens) and ``f_0 .. f_{n-1}`` (the target's
features) gives R = n - 1 draft rows, K steps:

    row p, step j:  feature f_p (step 0)   token x_{p+1+j} = step_tokens[p + j]
                    label  x_{p+2+j} = labels[p + j]   (the token the target committed there)

both padded by K - 1 (tokens) and K (labels, -1 = none) columns; labels at prompt tokens are
-1 too (the client's text, not the target's: a draft learns to predict the target). Step j's row p attends to
step 0's rows <= p and to its own steps 1 .. j (`ttt_mask`): what the draft's KV cache holds
when it drafts from that row. The loss is ``sum_j decay^j CE_j / sum_j decay^j`` against the
target's tokens, over the draft's hot vocabulary; the simulated chain acceptance feeds each
step the previous step's argmax, as `specmesh.demo.draft_train.chain_acceptance` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.draft_service.models.eagle1 import Eagle1Draft
from specmesh.draft_service.models.eagle3 import Eagle3Draft
from specmesh.draft_service.online.buffer import Window

IGNORE = -100
Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids -> the target's embeddings


@dataclass(frozen=True)
class TrainBatch:
    aux: torch.Tensor  # [B, R, feature_width], fp32, zero rows past a window's end
    step_tokens: torch.Tensor  # [B, R + K - 1] int64
    labels: torch.Tensor  # [B, R + K - 1] int64, target ids, -1 = none


def make_batch(
    windows: list[Window], num_steps: int, device: torch.device | str, prompt_labels: bool = False
) -> TrainBatch:
    """Windows as one right-padded batch (module docstring). Labels at tokens of a request's
    prompt are -1 unless ``prompt_labels``: the client wrote them, not the target."""
    num_rows = max(len(w.tokens) for w in windows) - 1
    width = num_rows + num_steps - 1
    aux = torch.zeros(len(windows), num_rows, windows[0].features.shape[1], device=device)
    step_tokens = torch.zeros(len(windows), width, dtype=torch.int64)
    labels = torch.full((len(windows), width), -1, dtype=torch.int64)
    for b, w in enumerate(windows):
        n = len(w.tokens)
        aux[b, : n - 1] = w.features[:-1].to(device=device, dtype=torch.float32)
        step_tokens[b, : n - 1] = w.tokens[1:]
        labels[b, : n - 2] = w.tokens[2:]
        if not prompt_labels:  # label column c is token c + 2
            labels[b, : max(min(w.first_output - 2, n - 2), 0)] = -1
    return TrainBatch(aux, step_tokens.to(device), labels.to(device))


def ttt_mask(num_rows: int, step: int, device: torch.device | str) -> torch.Tensor:
    """[R, (step + 1) R] bool: causal over step 0's rows, then each row's own later steps."""
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(num_rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class TrainableHead(nn.Module):
    """An fp32 copy of a served head's weights (same parameter names), trained on its own
    thread; the served module is only ever written by `load_into` on the draft's thread.
    Subclasses say how a step's block input is made and how its output becomes logits; the
    steps, the attention and the MLP are shared."""

    @property
    def layer(self) -> nn.Module:
        """The decoder layer: ``self_attn``, ``post_attention_layernorm``, ``mlp``."""
        raise NotImplementedError

    def _detach_fused(self) -> None:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        attn.qkv = attn.qkv_bias = mlp.gate_up = None  # the fused paths run no autograd
        self.rotary._cached = ()
        self.float().requires_grad_(True)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def label_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids; IGNORE where none (-1)."""
        return torch.where(target_ids >= 0, target_ids, torch.full_like(target_ids, IGNORE))

    def served_extras(self) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint of the served module carries besides the trained ones."""
        return {}

    def first_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        """Step 0's hidden input from the target's features."""
        raise NotImplementedError

    def block_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual it adds to) of a step."""
        raise NotImplementedError

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        aux: torch.Tensor,  # [B, R, feature_width]
        step_tokens: torch.Tensor,  # [B, R + K - 1]
        embed: Embed,
        num_steps: int,
        feed_drafted: bool = False,  # steps j >= 1 read the drafted token, not step_tokens
    ) -> list[torch.Tensor]:
        """Logits [B, R, draft_vocab] of each step; step j at row p predicts x_{p+2+j}."""
        num_rows, layer = aux.shape[1], self.layer
        hidden = self.first_hidden(aux)  # [B, R, H]
        keys, values, logits = [], [], []
        for step in range(num_steps):
            if feed_drafted and step > 0:
                tokens = self.to_target_ids(logits[-1].argmax(-1))  # [B, R]
            else:
                tokens = step_tokens[:, step : step + num_rows]
            u, residual = self.block_input(embed(tokens).to(hidden.dtype), hidden)
            positions = torch.arange(num_rows, device=u.device) + step
            q, k, v = self._project(u, positions)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(num_rows, step, u.device)
            r = residual + self._attend(q, keys, values, mask)
            hidden = r + layer.mlp(layer.post_attention_layernorm(r))  # fed to the next step
            logits.append(self.step_logits(hidden))
        return logits

    def _project(self, u: torch.Tensor, positions: torch.Tensor):
        """q [B, heads, R, hd], k and v [B, kv_heads, R, hd], RoPE from the draft's config."""
        attn = self.layer.self_attn
        b, t, _ = u.shape
        q = attn.q_proj(u).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(u).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(u).view(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotary(q, k, positions)  # cos / sin [R, 1, hd] broadcast over B and heads
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: torch.Tensor, keys: list, values: list, mask: torch.Tensor):
        attn = self.layer.self_attn
        groups = attn.num_heads // attn.num_kv_heads
        k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)  # [B, heads, (j+1) R, hd]
        v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
        return attn.o_proj(out.transpose(1, 2).flatten(2))  # [B, R, H]


class Eagle3Head(TrainableHead):
    """EAGLE-3: ``g = fc(aux)``; a step attends over ``[input_layernorm(embed), hidden_norm(g)]``
    and adds to ``g``; logits over the draft's hot vocabulary (``d2t``)."""

    def __init__(self, net: Eagle3Draft) -> None:
        super().__init__()
        self.fc = copy.deepcopy(net.fc)
        self.midlayer = copy.deepcopy(net.midlayer)
        self.norm = copy.deepcopy(net.norm)
        self.lm_head = copy.deepcopy(net.lm_head)
        self.rotary = copy.deepcopy(net.rotary)
        self._detach_fused()
        d2t = net.d2t.detach().clone()
        hot = torch.arange(len(d2t), device=d2t.device) + d2t  # target id of each draft id
        vocab = max(net.config.base.vocab_size, int(hot.max()) + 1)
        draft_of_target = torch.full((vocab,), IGNORE, dtype=torch.int64, device=d2t.device)
        draft_of_target[hot] = torch.arange(len(d2t), device=d2t.device)
        self.d2t, self.draft_of_target = d2t, draft_of_target

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def label_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids; IGNORE where none (-1) or outside the hot vocabulary."""
        ids = self.draft_of_target[target_ids.clamp(min=0)]
        return torch.where(target_ids >= 0, ids, torch.full_like(ids, IGNORE))

    @property
    def layer(self) -> nn.Module:
        return self.midlayer

    def served_extras(self) -> dict[str, torch.Tensor]:
        return {"d2t": self.d2t}

    def first_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux.to(self.fc.weight.dtype))

    def block_input(self, embeds, hidden):
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1), hidden

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden) @ self.lm_head.weight.t()


class Eagle1Head(TrainableHead):
    """EAGLE-1: step 0's hidden is the target's final hidden state; a step attends over
    ``u = fc([embed, hidden])`` (no input norm) and adds to it; logits through the target's own
    LM head, which is not trained (the draft's parameters are ``fc`` and ``layers.0``)."""

    def __init__(self, net: Eagle1Draft) -> None:
        super().__init__()
        self.fc = copy.deepcopy(net.fc)
        self.layers = copy.deepcopy(net.layers)
        self.rotary = copy.deepcopy(net.rotary)
        self._detach_fused()
        self._shared = net._shared  # the target's embedding and head, by reference

    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

    def first_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.to(self.fc.weight.dtype)

    def block_input(self, embeds, hidden):
        u = self.fc(torch.cat([embeds, hidden], -1))
        return u, u

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._shared[0].head_weight  # the target's dtype: no copy of it per step
        return (hidden.to(head.dtype) @ head.t()).to(hidden.dtype)


def trainable_head(net: nn.Module) -> TrainableHead:
    """The trainable copy of a served draft head of a kind that learns online."""
    if isinstance(net, Eagle3Draft):
        return Eagle3Head(net)
    if isinstance(net, Eagle1Draft):
        return Eagle1Head(net)
    raise ValueError(f"no online training for {type(net).__name__} heads")


def ttt_loss(
    head: TrainableHead, batch: TrainBatch, embed: Embed, num_steps: int, decay: float
) -> torch.Tensor:
    """The offline trainer's loss: ``sum_j decay^j CE_j / sum_j decay^j``, CE_j the mean
    cross-entropy of step j over rows with a hot-vocabulary label."""
    logits = head(batch.aux, batch.step_tokens, embed, num_steps)
    num_rows = batch.aux.shape[1]
    total, weights = 0.0, 0.0
    for step, step_logits in enumerate(logits):
        ids = head.label_ids(batch.labels[:, step : step + num_rows]).flatten()
        count = int((ids != IGNORE).sum())
        ce = F.cross_entropy(
            step_logits.float().flatten(0, 1), ids, ignore_index=IGNORE, reduction="sum"
        )
        total = total + decay**step * ce / max(count, 1)
        weights += decay**step
    return total / weights


@torch.no_grad()
def chain_accepted(
    head: TrainableHead, batch: TrainBatch, embed: Embed, depth: int, topk: int = 1
) -> tuple[int, int]:
    """(accepted draft tokens, round starts) of chains of ``depth`` from every row whose whole
    chain has labels, each accepted up to its first token the target did not commit.

    ``topk`` 1: greedy chains, each step fed the previous step's argmax. ``topk`` k: a step
    accepts when the committed token is among its k most likely (the children a tree search
    keeps), and the next step is fed the committed token, the path a tree's accepted branch
    follows."""
    logits = head(batch.aux, batch.step_tokens, embed, depth, feed_drafted=topk == 1)
    num_rows, labels = batch.aux.shape[1], batch.labels
    matches = []
    for j, step_logits in enumerate(logits):
        top = head.to_target_ids(step_logits.topk(topk, dim=-1).indices)  # [B, R, topk]
        matches.append((top == labels[:, j : j + num_rows, None]).any(-1))
    chain = torch.stack(matches, dim=-1).long().cumprod(dim=-1)  # [B, R, depth]
    valid = (labels[:, :num_rows] >= 0) & (labels[:, depth - 1 : depth - 1 + num_rows] >= 0)
    return int(chain.sum(-1)[valid].sum()), int(valid.sum())


def snapshot(head: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in head.named_parameters()}


@torch.no_grad()
def load_into(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``module``'s parameters of the same names, in place (so views of
    them, fused matrices and captured graphs, see the new values)."""
    for name, p in module.named_parameters():
        p.copy_(tensors[name])
