"""What online learning keeps and how hard it trains: torch-free, so the command line can read
the defaults and refuse a draft kind before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

# Draft kinds whose head trains online, with the training-time test loss of
# `specmesh.demo.draft_train` on their own forwards: EAGLE-3 and EAGLE-1 heads. MTP layers are
# whole decoder layers (a DeepSeek-V3 NextN layer is a mixture of experts) trained with their
# target; standalone LMs and n-gram lookup are not heads over the target's features (n-gram
# adapts by itself).
TRAINABLE_KINDS = ("eagle3", "eagle")
_WHY_NOT = {
    "ngram": "n-gram drafting has no weights (it already adapts: it looks up the request's own "
    "tokens)",
    "standalone": "a standalone draft LM reads no target features, so the rows the draft "
    "receives are no training data for it",
    "mtp": "MTP layers are not trained online (only EAGLE-3 and EAGLE-1 heads)",
}


def refuse_kind(kind: str) -> None:
    """Raise ``ValueError`` naming why ``kind`` cannot learn online, unless it can."""
    if kind not in TRAINABLE_KINDS:
        why = _WHY_NOT.get(kind, f"draft kind {kind!r} is unknown")
        raise ValueError(f"--online-learning needs --kind eagle3 or eagle, not {kind}: {why}")


@dataclass(frozen=True)
class OnlineSettings:
    """Memory: ``train_tokens + heldout_sequences * heldout_sequence_tokens`` feature rows of
    ``feature width x 2`` bytes (bf16) plus an int64 token each, on the draft's device; and the
    head three more times in fp32 (trained copy, the served and the shipped weights' snapshots)
    plus AdamW's two moments."""

    train_tokens: int = 65536  # rows kept to train on, oldest requests dropped first
    heldout_every: int = 8  # one request in this many is held out (never trained on)
    heldout_sequences: int = 32  # held-out requests kept: half the most recent, half a reservoir
    heldout_sequence_tokens: int = 512  # rows kept of each held-out request
    min_sequence_tokens: int = 8  # a request that ends with fewer rows is dropped (warm-up)
    window_tokens: int = 256  # rows per training window (one request's consecutive rows)
    batch_windows: int = 4  # windows per optimizer step
    num_steps: int = 4  # training-time test depth K (the offline trainer's)
    prompt_labels: bool = False  # also learn the prompts' tokens (the client's, not the target's)
    decay: float = 0.8  # step j's loss weight decay^j (the offline trainer's)
    lr: float = 5e-5  # 2e-4 overshot: the demo pair's early updates lowered held-out acceptance
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    update_tokens: int = 4096  # new training rows between two updates
    steps_per_update: int = 16  # optimizer steps in one update, the guard judges them together
    min_heldout_rounds: int = 64  # held-out round starts needed before the first update
    guard_threshold: float = 0.05  # accepted drafts may not fall below (1 - this) x the shipped
    yield_s: float = 0.0  # sleep between two optimizer steps (0: only yield the interpreter)
    keep_checkpoints: int = 2  # newest checkpoints kept in --online-learning-dir
    seed: int = 0

    def validate(self) -> None:
        positive = ("train_tokens", "heldout_every", "heldout_sequences", "window_tokens",
                    "batch_windows", "num_steps", "update_tokens", "steps_per_update",
                    "keep_checkpoints")  # fmt: skip
        bad = [name for name in positive if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"online learning settings must be >= 1: {', '.join(bad)}")
        if self.window_tokens < self.num_steps + 2:
            raise ValueError(
                f"window_tokens {self.window_tokens} < num_steps + 2 = {self.num_steps + 2}"
            )
        if not self.lr > 0.0:
            raise ValueError(f"online learning rate must be > 0, got {self.lr}")
        if not 0.0 <= self.guard_threshold < 1.0:
            raise ValueError(f"guard_threshold must be in [0, 1), got {self.guard_threshold}")
