"""A one-layer EAGLE-3 draft with the SpecForge/SGLang tensor names, its checkpoint writer and
reader.

Forward of draft step j at row p (eagle.md §1.3), for target position p:

    hidden_0 = fc(concat(aux_low_p, aux_mid_p, aux_high_p))   # [H]   (step 0 only)
    hidden_j = y_{j-1}                                         # [H]   (pre-norm output)
    u = concat(input_layernorm(embed(token_j)), hidden_norm(hidden_j))   # [2H], embedding first
    r = hidden_j + o_proj(attn(u))            # RoPE from the draft's own config, pos p + j
    y_j = r + mlp(post_attention_layernorm(r))
    logits_j = lm_head(norm(y_j))             # over the draft vocab; target id = d + d2t[d]

Keys seen by step j at row p (training-time test, one explicit boolean mask):

    columns:  step 0 rows 0..T-1 | step 1 rows 0..T-1 | ... | step j rows 0..T-1
    row p:    causal (cols <= p) | only col p         | ... | only col p

which is what the engine's draft KV cache holds at decode time: the prefix written by step 0
(draft extend) plus the chain of this row's own earlier steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (half-split, `rotate_half`) rotary embedding; x [B, heads, T, hd], positions [T]."""
    head_dim = x.shape[-1]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim
    inv_freq = 1.0 / theta**exponents
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def ttt_mask(num_rows: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, (step+1)*T] bool: causal over step-0 keys, then this row's own earlier-step keys."""
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(num_rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class DraftAttention(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        hd, width = shape.head_dim, 2 * shape.hidden_size
        self.q_proj = nn.Linear(width, shape.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, shape.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, shape.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * hd, shape.hidden_size, bias=False)
        self.shape = shape

    def heads(self, x: torch.Tensor, num: int) -> torch.Tensor:
        return x.unflatten(-1, (num, self.shape.head_dim)).transpose(1, 2)  # [B, heads, T, hd]

    def project(self, u: torch.Tensor, positions: torch.Tensor):
        s = self.shape
        q = rope(self.heads(self.q_proj(u), s.num_heads), positions, s.rope_theta)
        k = rope(self.heads(self.k_proj(u), s.num_kv_heads), positions, s.rope_theta)
        v = self.heads(self.v_proj(u), s.num_kv_heads)
        return q, k, v

    def attend(self, q, keys, values, mask) -> torch.Tensor:
        groups = self.shape.num_heads // self.shape.num_kv_heads
        k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)  # [B, nh, (j+1)T, hd]
        v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).flatten(2))  # [B, T, H]


class DraftMLP(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)  # the embedding
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)  # the fc / y stream
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DraftAttention(shape)
        self.mlp = DraftMLP(shape)


class Eagle3Draft(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(3 * shape.target_hidden_size, shape.hidden_size, bias=False)
        self.midlayer = DraftLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(shape.vocab_size, dtype=torch.bool))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def set_hot_vocab(self, hot_ids: torch.Tensor) -> None:
        """`hot_ids` [Vd], ascending target ids; d2t is an offset (target = draft + d2t[draft])."""
        self.d2t.copy_(hot_ids - torch.arange(hot_ids.numel(), device=hot_ids.device))
        self.t2d.zero_()
        self.t2d[hot_ids] = True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Target ids to draft ids; ids outside the hot vocabulary become `ignore_index`."""
        draft_of_target = torch.cumsum(self.t2d.long(), 0) - 1  # [V]
        mapped = draft_of_target[target_ids]
        return torch.where(self.t2d[target_ids], mapped, torch.full_like(mapped, ignore_index))

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, 3*Ht], row p = target position p
        step_tokens: torch.Tensor,  # [B, T + K - 1], column p + j = the token of row p, step j
        embed_weight: torch.Tensor,  # [V, H], the target's embed_tokens
        num_steps: int,
        feed_drafted: bool = False,  # steps j >= 1 read the drafted token, not step_tokens
    ) -> list[torch.Tensor]:
        """Logits [B, T, Vd] for each draft step; step j at row p predicts x_{p+2+j}."""
        num_rows = aux_hidden.shape[1]
        layer = self.midlayer
        hidden = self.fc(aux_hidden)  # [B, T, H]
        keys, values, logits = [], [], []
        for step in range(num_steps):
            if feed_drafted and step > 0:
                tokens = self.to_target_ids(logits[-1].argmax(-1))  # [B, T]
            else:
                tokens = step_tokens[:, step : step + num_rows]  # [B, T]
            embeds = F.embedding(tokens, embed_weight).to(hidden.dtype)  # [B, T, H]
            u = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
            positions = torch.arange(num_rows, device=u.device) + step
            q, k, v = layer.self_attn.project(u, positions)
            keys.append(k)
            values.append(v)
            mask = ttt_mask(num_rows, step, u.device)  # born on the device: no host copy
            r = hidden + layer.self_attn.attend(q, keys, values, mask)
            hidden = r + layer.mlp(layer.post_attention_layernorm(r))  # y_j, pre-norm
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def draft_config(shape: DraftShape, aux_layer_ids: list[int], special_ids: dict[str, int]) -> dict:
    """SpecForge/SGLang `LlamaForCausalLMEagle3` config; ids in the output-of-layer convention."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "target_hidden_size": shape.target_hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "bias": False,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        **special_ids,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "aux_layer_id_convention": "output_of_layer",
            "use_aux_hidden_state": True,
        },
    }


def save_draft(draft: Eagle3Draft, config: dict, draft_dir: Path) -> None:
    draft_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
        for name, t in draft.state_dict().items()
    }
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_draft(draft_dir: Path) -> Eagle3Draft:
    """A draft written by `save_draft`, in fp32 and in eval mode, on the CPU."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    shape = DraftShape(
        hidden_size=config["hidden_size"],
        target_hidden_size=config["target_hidden_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=config["rms_norm_eps"],
    )
    draft = Eagle3Draft(shape)
    draft.load_state_dict(load_file(str(Path(draft_dir) / "model.safetensors")))
    return draft.eval().requires_grad_(False)
