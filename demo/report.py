"""`TrainedPair` (what `make.train_pair` produced) and the `DemoReport` built from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specmesh.demo.card import DemoReport
from specmesh.demo.draft_train import ChainStats, aux_layer_ids
from specmesh.demo.eagle3 import Eagle3Draft
from specmesh.demo.loop import LoopStats
from specmesh.demo.prepare import PreparedData
from specmesh.demo.target import HeldoutLoss


@dataclass(frozen=True)
class TrainedPair:
    prepared: PreparedData
    target: LlamaForCausalLM  # shipped bf16 weights, upcast to fp32, frozen
    target_stats: LoopStats
    target_eval: HeldoutLoss  # held-out stdlib windows
    eval_only_eval: HeldoutLoss | None  # eval-only text windows (extra sources only)
    draft: Eagle3Draft
    draft_stats: LoopStats
    hot_vocab_coverage: float
    step_accuracy: list[float]
    chain: ChainStats


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def _megabytes(path: Path) -> float:
    return path.stat().st_size / 1e6


def build_report(pair: TrainedPair, out_dir: Path, **run: object) -> DemoReport:
    corpus, prepared = pair.prepared.corpus, pair.prepared
    eval_only = pair.eval_only_eval
    return DemoReport(
        out_dir=str(out_dir),
        **run,
        python_version=corpus.python_version,
        data_seconds=prepared.seconds,
        sources=corpus.sources,
        package_bytes=corpus.package_bytes,
        num_train_files=len(corpus.train.files),
        num_heldout_files=len(corpus.heldout.files),
        train_bytes=corpus.train.num_bytes,
        heldout_bytes=corpus.heldout.num_bytes,
        train_tokens=prepared.train_stream.numel(),
        heldout_tokens=prepared.heldout_stream.numel(),
        eval_only_tokens=prepared.eval_only_stream.numel(),
        vocab_size=len(prepared.tokenizer),
        draft_vocab_size=pair.draft.shape.draft_vocab_size,
        hot_vocab_coverage=pair.hot_vocab_coverage,
        target_params=sum(p.numel() for p in pair.target.parameters()),
        target_mb=_megabytes(out_dir / "target" / "model.safetensors"),
        target_steps=pair.target_stats.num_steps,
        target_train_tokens=pair.target_stats.num_tokens,
        target_seconds=pair.target_stats.seconds,
        target_train_loss=pair.target_stats.final_loss,
        target_eval_loss=pair.target_eval.nats_per_token,
        target_eval_bits_per_byte=pair.target_eval.bits_per_byte,
        eval_only_loss=None if eval_only is None else eval_only.nats_per_token,
        eval_only_bits_per_byte=None if eval_only is None else eval_only.bits_per_byte,
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
