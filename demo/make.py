"""`make_demo`: corpus -> tokenizer -> target -> EAGLE-3 draft -> evals -> model card."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from specmesh.demo import data as demo_data
from specmesh.demo.card import DemoReport, render_card
from specmesh.demo.config import PRESETS, DemoConfig
from specmesh.demo.draft_train import (
    ChainStats,
    aux_layer_ids,
    chain_acceptance,
    step_accuracy,
    ttt_loss,
)
from specmesh.demo.eagle3 import DraftShape, Eagle3Draft, draft_config, save_draft
from specmesh.demo.loop import LoopStats, train_timed
from specmesh.demo.prepare import PreparedData, hot_vocab, prepare_data
from specmesh.demo.progress import Progress
from specmesh.demo.report import TrainedPair, build_report, describe_device
from specmesh.demo.target import (
    HeldoutLoss,
    build_target,
    eval_loss,
    load_target_fp32,
    save_target,
    target_loss,
)
from specmesh.demo.text import LOOPING_PROMPTS, README_PROMPTS, greedy_continuations


def train_target(
    cfg: DemoConfig, prepared: PreparedData, seed: int, budget_s: float, show: bool,
    init_from: Path | None = None,
) -> tuple[LlamaForCausalLM, LoopStats]:  # fmt: skip
    """A fresh target, or ``init_from``'s (an earlier run's pair dir) trained further."""
    torch.manual_seed(seed)
    device = prepared.train_stream.device
    if init_from is None:
        model = build_target(cfg, prepared.tokenizer).to(device)
    else:
        model = load_target_fp32(init_from / "target", device).requires_grad_(True).train()
        shape = (model.config.num_hidden_layers, model.config.hidden_size)
        if shape != (cfg.num_layers, cfg.hidden_size):
            raise ValueError(f"{init_from}: a target of {shape} (layers, hidden), not the preset's")
    if cfg.target_max_steps == 0:  # the earlier run's target as it is: a new draft only
        return model.eval(), LoopStats(0, 0, 0.0, float("nan"))
    generator = torch.Generator().manual_seed(seed)
    stats = train_timed(
        [p for p in model.parameters() if p.requires_grad],
        lambda windows: target_loss(model, windows),
        lambda n, length: demo_data.sample_windows(prepared.train_stream, n, length, generator),
        cfg,
        peak_lr=cfg.target_lr,
        budget_s=budget_s,
        max_steps=cfg.target_max_steps,
        bar=Progress("target", show),
    )
    return model, stats


def build_draft(cfg: DemoConfig, target: LlamaForCausalLM, hot_ids: torch.Tensor) -> Eagle3Draft:
    """Fresh draft; its head starts as the target's (tied) head restricted to the hot ids."""
    shape = DraftShape(
        hidden_size=cfg.hidden_size,
        target_hidden_size=target.config.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.draft_intermediate_size,
        vocab_size=target.config.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        rope_theta=cfg.draft_rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=target.config.rms_norm_eps,
    )
    draft = Eagle3Draft(shape).to(hot_ids.device)
    draft.set_hot_vocab(hot_ids)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[hot_ids])
        draft.norm.weight.copy_(target.model.norm.weight)
    return draft


def train_draft(
    cfg: DemoConfig, draft: Eagle3Draft, target: LlamaForCausalLM, prepared: PreparedData,
    seed: int, budget_s: float, show: bool,
) -> LoopStats:  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 1)
    draft.train()
    return train_timed(
        list(draft.parameters()),
        lambda w: ttt_loss(draft, target, w, cfg.num_draft_steps, cfg.step_loss_decay),
        lambda n, length: demo_data.sample_windows(prepared.train_stream, n, length, generator),
        cfg,
        peak_lr=cfg.draft_lr,
        budget_s=budget_s,
        max_steps=cfg.draft_max_steps,
        bar=Progress("draft", show),
    )


def evaluate_draft(
    cfg: DemoConfig, draft: Eagle3Draft, target: LlamaForCausalLM, prepared: PreparedData
) -> tuple[list[float], ChainStats]:
    stream = prepared.heldout_stream
    windows = demo_data.heldout_windows(stream, cfg.eval_windows, cfg.short_context)
    accuracy = step_accuracy(draft, target, windows, cfg.num_draft_steps)
    prompts = demo_data.heldout_windows(stream, cfg.chain_prompts, cfg.chain_prompt_len)
    chain = chain_acceptance(draft, target, prompts, cfg.chain_new_tokens, cfg.num_draft_steps)
    return accuracy, chain


def evaluate_target(
    cfg: DemoConfig, target: LlamaForCausalLM, prepared: PreparedData
) -> tuple[HeldoutLoss, HeldoutLoss | None]:
    """Loss on evenly spaced windows of the held-out stdlib files and of the eval-only text."""

    def on(stream: torch.Tensor) -> HeldoutLoss:
        windows = demo_data.heldout_windows(stream, cfg.eval_windows, cfg.short_context)
        return eval_loss(target, windows, prepared.byte_lengths)

    heldout = on(prepared.heldout_stream)
    if prepared.eval_only_stream.numel() <= cfg.short_context:  # no eval-only text
        return heldout, None
    return heldout, on(prepared.eval_only_stream)


def train_pair(
    cfg: DemoConfig, out_dir: Path, seed: int, deadline: float, device: torch.device, show: bool,
    init_from: Path | None = None,
) -> TrainedPair:  # fmt: skip
    """Every stage, in order, writing `out_dir/target` and `out_dir/draft` on the way."""
    log = Progress("demo", show)
    tokenizer = None if init_from is None else AutoTokenizer.from_pretrained(init_from / "target")
    prepared = prepare_data(cfg, device, log, tokenizer=tokenizer)
    corpus = prepared.corpus
    log.note(
        f"{len(corpus.train.files)} train / {len(corpus.heldout.files)} held-out files, "
        f"{prepared.train_stream.numel():,} train tokens"
    )
    budget_s = (deadline - time.monotonic() - cfg.eval_reserve_s) * cfg.target_time_share
    model, target_stats = train_target(cfg, prepared, seed, max(budget_s, 1.0), show, init_from)
    save_target(model, prepared.tokenizer, out_dir / "target")
    target = load_target_fp32(out_dir / "target", device)
    target_eval, eval_only_eval = evaluate_target(cfg, target, prepared)
    log.note(
        f"target eval loss {target_eval.nats_per_token:.3f} nats/token, "
        f"{target_eval.bits_per_byte:.3f} bits/byte"
        + (f"; eval-only {eval_only_eval.bits_per_byte:.3f} bits/byte" if eval_only_eval else "")
    )

    hot_ids, coverage = hot_vocab(cfg, prepared)
    torch.manual_seed(seed + 1)
    draft = build_draft(cfg, target, hot_ids)
    budget_s = deadline - time.monotonic() - cfg.eval_reserve_s
    draft_stats = train_draft(cfg, draft, target, prepared, seed, max(budget_s, 1.0), show)
    special_ids = {
        name: getattr(prepared.tokenizer, name)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    layer_ids = aux_layer_ids(target.config.num_hidden_layers)
    save_draft(draft, draft_config(draft.shape, layer_ids, special_ids), out_dir / "draft")
    accuracy, chain = evaluate_draft(cfg, draft, target, prepared)
    log.note(
        f"draft step accuracy {[round(a, 3) for a in accuracy]}, "
        f"chain {chain.mean_accept_length:.2f} tokens/round"
    )
    return TrainedPair(
        prepared, target, target_stats, target_eval, eval_only_eval, draft, draft_stats,
        coverage, accuracy, chain,
    )  # fmt: skip


def resolve_device(device: str) -> torch.device:
    resolved = torch.device(device)
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return resolved


def resolve_preset(preset: str | None, quick: bool) -> str:
    """`quick=True` is the older spelling of `preset="quick"`."""
    if quick and preset not in (None, "quick"):
        raise ValueError(f"quick=True contradicts preset={preset!r}")
    name = "quick" if quick else preset or "full"
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return name


def make_demo(
    out_dir: Path,
    *,
    seed: int = 0,
    time_budget_s: float = 14400.0,
    preset: str | None = None,
    quick: bool = False,
    device: str = "cpu",
    progress: bool = True,
    init_from: Path | None = None,
) -> DemoReport:
    """Train the demo target and its EAGLE-3 draft into `out_dir/{target,draft}` + README.md.

    `time_budget_s` is the whole run's wall-clock budget from the call, data preparation
    included (the gpu run trains until it is spent, full and quick end on their steps or on
    it); `preset` names a configuration
    of `config.PRESETS` ("full" by default; "quick", or `quick=True`, is a tiny seconds-long
    run on a slice of the corpus, for tests); `device` is "cpu" or "cuda". ``init_from``: the
    dir of an earlier run of the same preset, whose target (tokenizer and weights) this run
    trains for its own schedule again, from warm-up (a restart), before training a new draft.
    """
    if time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s}")
    start = time.monotonic()
    name, torch_device = resolve_preset(preset, quick), resolve_device(device)
    cfg = PRESETS[name]
    out_dir = Path(out_dir)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' own save/load bars
    try:
        pair = train_pair(
            cfg, out_dir, seed, start + time_budget_s, torch_device, progress,
            None if init_from is None else Path(init_from),
        )  # fmt: skip
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    readme = greedy_continuations(str(out_dir / "target"), README_PROMPTS + LOOPING_PROMPTS)
    report = build_report(
        pair, out_dir, preset=name, seed=seed, time_budget_s=time_budget_s,
        total_seconds=time.monotonic() - start, device=torch_device.type,
        device_name=describe_device(torch_device),
        init_from=None if init_from is None else str(init_from),
        readme_continuations=[(c.prompt, c.text, c.repeat.count) for c in readme],
    )  # fmt: skip
    heldout = pair.prepared.corpus.heldout.files
    (out_dir / "heldout_files.txt").write_text("\n".join(heldout) + "\n")
    (out_dir / "README.md").write_text(render_card(report, cfg, heldout))
    return report
