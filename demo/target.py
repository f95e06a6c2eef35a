"""The demo target: a small `LlamaForCausalLM` (tied embeddings) trained from scratch."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specmesh.demo.config import DemoConfig

# The demo's chat template (written as `chat_template.jinja`, what /v1/chat/completions renders):
# the model has only read Python files, so each message becomes a comment line naming its role,
# then its text, and the assistant's turn opens with "# assistant:" for the model to continue,
# in Python. BOS first, as templates write it (the router drops it when its tokenizer adds one).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "# {{ message['role'] }}:\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def build_target(cfg: DemoConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def target_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over a batch of windows [batch, length]."""
    with torch.autocast(windows.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=windows).logits  # [batch, length, vocab]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), windows[:, 1:].flatten()
    )


@dataclass(frozen=True)
class HeldoutLoss:
    """Next-token loss summed over evaluated windows; sums of batches add up."""

    nll: float  # nats, summed over the predicted tokens
    num_tokens: int  # predicted tokens
    num_bytes: int  # UTF-8 bytes of the text those tokens decode to (special tokens: none)

    def __add__(self, other: HeldoutLoss) -> HeldoutLoss:
        return HeldoutLoss(
            self.nll + other.nll,
            self.num_tokens + other.num_tokens,
            self.num_bytes + other.num_bytes,
        )

    @property
    def nats_per_token(self) -> float:
        return self.nll / self.num_tokens

    @property
    def bits_per_byte(self) -> float:
        """nats/token * tokens / bytes / ln 2: comparable across tokenizers on the same text."""
        return self.nll / self.num_bytes / math.log(2)


@torch.no_grad()
def eval_loss(
    model: LlamaForCausalLM,
    windows: torch.Tensor,  # [num_windows, length] on the model's device
    byte_lengths: torch.Tensor,  # [vocab] int64, `data.token_byte_lengths`, on the same device
    batch_size: int = 8,
) -> HeldoutLoss:
    """Summed per-token cross-entropy in fp32 over held-out windows."""
    model.eval()
    total, count, num_bytes = 0.0, 0, 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk).logits.float()  # [batch, length, vocab]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        )
        total += nll.item()
        count += chunk[:, 1:].numel()
        num_bytes += int(byte_lengths[chunk[:, 1:]].sum())
    return HeldoutLoss(total, count, num_bytes)


def save_target(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, target_dir: Path
) -> None:
    model.to(torch.bfloat16).save_pretrained(target_dir, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target_dir)
    # The class name every transformers release knows (5.x writes its own "TokenizersBackend").
    config_path = target_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    # tokenizer.json without indentation: 107 KB instead of 264 (the repository's budget).
    tokenizer.backend_tokenizer.save(str(target_dir / "tokenizer.json"), pretty=False)


def load_target_fp32(target_dir: Path, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The shipped bf16 target, upcast to fp32 and frozen (the draft trains against this)."""
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    model.eval().requires_grad_(False)
    return model
