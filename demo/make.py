"""`make_demo`: corpus -> tokenizer -> target -> EAGLE-3 draft -> evals -> model card."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from specmesh.demo import data as demo_data
from specmesh.demo.card import DemoReport, render_card
from specmesh.demo.config import FULL, QUICK, DemoConfig
from specmesh.demo.draft_train import (
    ChainStats,
    aux_layer_ids,
    chain_acceptance,
    step_accuracy,
    ttt_loss,
)
from specmesh.demo.eagle3 import DraftShape, Eagle3Draft, draft_config, save_draft
from specmesh.demo.loop import LoopStats, train_timed
from specmesh.demo.progress import Progress
from specmesh.demo.target import build_target, eval_loss, load_target_fp32, save_target, target_loss


@dataclass(frozen=True)
class PreparedData:
    corpus: demo_data.Corpus
    tokenizer: PreTrainedTokenizerFast
    train_stream: torch.Tensor  # [train_tokens] int64, files concatenated
    heldout_stream: torch.Tensor  # [heldout_tokens] int64


def prepare_data(cfg: DemoConfig) -> PreparedData:
    corpus = demo_data.load_corpus(cfg.heldout_percent, cfg.max_train_bytes, cfg.max_heldout_bytes)
    tokenizer = demo_data.train_tokenizer(
        corpus.train_texts, cfg.vocab_size, cfg.max_position_embeddings
    )
    train_stream = torch.cat(demo_data.encode_files(tokenizer, corpus.train_texts))
    heldout_stream = torch.cat(demo_data.encode_files(tokenizer, corpus.heldout_texts))
    return PreparedData(corpus, tokenizer, train_stream, heldout_stream)


def hot_vocab(cfg: DemoConfig, prepared: PreparedData) -> tuple[torch.Tensor, float]:
    """The `draft_vocab_size` most frequent training ids (eos always in), ascending; coverage."""
    counts = demo_data.token_counts(prepared.train_stream, len(prepared.tokenizer)).double()
    ranking = counts.clone()
    ranking[prepared.tokenizer.eos_token_id] = float("inf")
    hot_ids = ranking.topk(cfg.draft_vocab_size).indices.sort().values
    return hot_ids, float(counts[hot_ids].sum() / counts.sum())


def train_target(
    cfg: DemoConfig, prepared: PreparedData, seed: int, budget_s: float, show: bool
) -> tuple[LlamaForCausalLM, LoopStats]:
    torch.manual_seed(seed)
    model = build_target(cfg, prepared.tokenizer)
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
    draft = Eagle3Draft(shape)
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


@dataclass(frozen=True)
class TrainedPair:
    prepared: PreparedData
    target: LlamaForCausalLM  # shipped bf16 weights, upcast to fp32, frozen
    target_stats: LoopStats
    target_eval_loss: float
    draft: Eagle3Draft
    draft_stats: LoopStats
    hot_vocab_coverage: float
    step_accuracy: list[float]
    chain: ChainStats


def train_pair(
    cfg: DemoConfig, out_dir: Path, seed: int, deadline: float, show: bool
) -> TrainedPair:
    """Every stage, in order, writing `out_dir/target` and `out_dir/draft` on the way."""
    log = Progress("demo", show)
    prepared = prepare_data(cfg)
    log.note(
        f"{len(prepared.corpus.train_files)} train / {len(prepared.corpus.heldout_files)} "
        f"held-out files, {prepared.train_stream.numel():,} train tokens"
    )
    budget_s = (deadline - time.monotonic() - cfg.eval_reserve_s) * cfg.target_time_share
    model, target_stats = train_target(cfg, prepared, seed, max(budget_s, 1.0), show)
    save_target(model, prepared.tokenizer, out_dir / "target")
    target = load_target_fp32(out_dir / "target")
    windows = demo_data.heldout_windows(
        prepared.heldout_stream, cfg.eval_windows, cfg.short_context
    )
    target_eval = eval_loss(target, windows)
    log.note(f"target eval loss {target_eval:.3f} nats/token")

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
        prepared, target, target_stats, target_eval, draft, draft_stats, coverage, accuracy, chain
    )


def _megabytes(path: Path) -> float:
    return path.stat().st_size / 1e6


def build_report(pair: TrainedPair, out_dir: Path, **run: object) -> DemoReport:
    corpus, prepared = pair.prepared.corpus, pair.prepared
    return DemoReport(
        out_dir=str(out_dir),
        **run,
        python_version=corpus.python_version,
        num_train_files=len(corpus.train_files),
        num_heldout_files=len(corpus.heldout_files),
        train_bytes=corpus.num_train_bytes,
        heldout_bytes=corpus.num_heldout_bytes,
        train_tokens=prepared.train_stream.numel(),
        heldout_tokens=prepared.heldout_stream.numel(),
        vocab_size=len(prepared.tokenizer),
        draft_vocab_size=pair.draft.shape.draft_vocab_size,
        hot_vocab_coverage=pair.hot_vocab_coverage,
        target_params=sum(p.numel() for p in pair.target.parameters()),
        target_mb=_megabytes(out_dir / "target" / "model.safetensors"),
        target_steps=pair.target_stats.num_steps,
        target_train_tokens=pair.target_stats.num_tokens,
        target_seconds=pair.target_stats.seconds,
        target_train_loss=pair.target_stats.final_loss,
        target_eval_loss=pair.target_eval_loss,
        draft_params=sum(p.numel() for p in pair.draft.parameters()),
        draft_mb=_megabytes(out_dir / "draft" / "model.safetensors"),
        aux_layer_ids=aux_layer_ids(pair.target.config.num_hidden_layers),
        draft_steps=pair.draft_stats.num_steps,
        draft_train_tokens=pair.draft_stats.num_tokens,
        draft_seconds=pair.draft_stats.seconds,
        draft_train_loss=pair.draft_stats.final_loss,
        draft_step_accuracy=pair.step_accuracy,
        chain_conditional_acceptance=pair.chain.conditional_acceptance,
        chain_mean_accept_length=pair.chain.mean_accept_length,
        chain_rounds=pair.chain.num_rounds,
    )


def make_demo(
    out_dir: Path,
    *,
    seed: int = 0,
    time_budget_s: float = 900.0,
    quick: bool = False,
    progress: bool = True,
) -> DemoReport:
    """Train the demo target and its EAGLE-3 draft into `out_dir/{target,draft}` + README.md.

    `time_budget_s` is the whole run's wall-clock budget (the full run trains until it is
    spent); `quick=True` is a tiny seconds-long run on a slice of the corpus, for tests.
    """
    if time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s}")
    start = time.monotonic()
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' own save/load bars
    try:
        pair = train_pair(cfg, out_dir, seed, start + time_budget_s, progress)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    report = build_report(
        pair, out_dir, quick=quick, seed=seed, time_budget_s=time_budget_s,
        total_seconds=time.monotonic() - start,
        num_cpu_threads=torch.get_num_threads(),
    )  # fmt: skip
    heldout = pair.prepared.corpus.heldout_files
    (out_dir / "heldout_files.txt").write_text("\n".join(heldout) + "\n")
    (out_dir / "README.md").write_text(render_card(report, cfg, heldout))
    return report
