"""The time-budgeted optimisation loop shared by the target and the draft.

Progress is the larger of "time spent / budget" and "steps done / max steps"; the learning rate
(linear warm-up, then cosine to `min_lr_ratio`) and the window length follow that progress, so
a run always ends on the budget however busy the machine is. Loads change the number of steps,
never the shape of the schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh.demo.config import DemoConfig
from specmesh.demo.progress import Progress


@dataclass(frozen=True)
class LoopStats:
    num_steps: int
    num_tokens: int
    seconds: float
    final_loss: float  # exponential moving average of the training loss


def learning_rate(cfg: DemoConfig, peak_lr: float, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return peak_lr * warmup * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(params: list[torch.nn.Parameter], cfg: DemoConfig) -> torch.optim.AdamW:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = True if params[0].is_cuda else None  # one kernel per step on the GPU
    return torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train_timed(
    params: list[torch.nn.Parameter],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    sample: Callable[[int, int], torch.Tensor],
    cfg: DemoConfig,
    *,
    peak_lr: float,
    budget_s: float,
    max_steps: int | None,
    bar: Progress,
) -> LoopStats:
    """Minimise `loss_fn(windows)` over windows from `sample(batch, length)` until the budget."""
    optimizer = make_optimizer(params, cfg)
    start = time.monotonic()
    step, num_tokens, ema = 0, 0, float("nan")
    while True:
        progress = (time.monotonic() - start) / budget_s
        if max_steps is not None:
            progress = max(progress, step / max_steps)
        if progress >= 1.0:
            break
        lr = learning_rate(cfg, peak_lr, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        long = progress >= cfg.long_context_from
        length = cfg.long_context if long else cfg.short_context
        windows = sample(max(1, cfg.batch_tokens // length), length)  # [batch, length]
        loss = loss_fn(windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        value = loss.item()
        ema = value if math.isnan(ema) else 0.95 * ema + 0.05 * value
        step += 1
        num_tokens += windows.numel()
        bar.update(progress, f"step {step} ctx {length} lr {lr:.1e} loss {ema:.3f}")
    seconds = time.monotonic() - start
    bar.done(f"{step} steps, {num_tokens / 1e6:.2f}M tokens, {seconds:.0f}s, loss {ema:.3f}")
    return LoopStats(step, num_tokens, seconds, ema)
