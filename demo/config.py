"""Sizes and training settings of the demo pair: one frozen dataclass, a preset per kind of run.

FULL is the CPU recipe of the shipped pair, QUICK a seconds-long test run, GPU a larger target
trained on more text with large batches on one big GPU in a few minutes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DemoConfig:
    # Data and tokenizer.
    vocab_size: int = 4096  # byte-level BPE, 3 special tokens included
    draft_vocab_size: int = 2048  # hot vocabulary of the draft head (d2t / t2d)
    heldout_percent: int = 5  # share of stdlib files held out, chosen by path hash
    max_train_bytes: int | None = None  # cap on the training text (quick mode)
    max_heldout_bytes: int | None = None
    extra_sources: bool = False  # also the installed packages' sources (demo/corpus.py)
    max_eval_only_bytes: int = 4_000_000  # torch / transformers sample, eval only (extra sources)
    tokenizer_train_bytes: int | None = None  # BPE on a path-hash sample of this size; None: all
    # Target: a Llama with tied input/output embeddings.
    hidden_size: int = 256
    num_layers: int = 8  # >= 7 so the three EAGLE-3 taps [2, L//2, L-3] are distinct
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 512
    # Draft: one EAGLE-3 layer, same width and heads as the target, its own RoPE base.
    draft_intermediate_size: int = 688
    draft_rope_theta: float = 100_000.0  # deliberately unlike the target's (eagle.md §1.1)
    num_draft_steps: int = 4  # training-time-test depth K
    step_loss_decay: float = 0.8  # step j is weighted decay**j
    # Optimisation (AdamW, warm-up then cosine over the time budget).
    batch_tokens: int = 2048  # tokens per optimiser step
    short_context: int = 256  # window length for most of training
    long_context: int = 512  # window length for the last part (max_position_embeddings)
    long_context_from: float = 0.75  # progress fraction where long windows start
    target_lr: float = 2e-3
    draft_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    target_time_share: float = 0.62  # of the training time; the draft gets the rest
    target_max_steps: int | None = None  # quick mode ends on steps, not on the clock
    draft_max_steps: int | None = None
    eval_reserve_s: float = 45.0  # kept back from the budget for evaluation and saving
    lineage: str = ""  # the earlier runs an init_from run builds on, for the model card
    init_from_name: str = "EARLIER_RUN"  # how the card names the init_from run (not its path)
    # Evaluation.
    eval_windows: int = 48  # held-out windows of short_context for loss / step accuracy
    chain_prompts: int = 8  # held-out prompts for the greedy chain simulation
    chain_prompt_len: int = 96
    chain_new_tokens: int = 96

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# The shipped pair (issue 50: text first): two runs of this preset, the second training the
# first's target again (`make_demo(init_from=...)`). The target is 10 layers deep (a CPU forward
# of these sizes costs about the same per layer, so depth makes the one-layer draft cheap beside
# it): 8.3M parameters, 16.6 MB in bf16. Each run ends on its steps, not on the clock, so a busy
# machine makes it longer, not the pair worse.
FULL = DemoConfig(num_layers=10, target_max_steps=1800, draft_max_steps=1000)
# The second run: the stdlib alone is 2.4M tokens, which the first run read 1.5 times over (its
# held-out loss trailed its training loss by 0.42 nats/token), so this one adds a path-hash
# sample of the installed packages' sources.
FULL_MORE = replace(FULL, extra_sources=True, max_train_bytes=24_000_000)

QUICK = DemoConfig(
    vocab_size=512,
    draft_vocab_size=256,
    max_train_bytes=300_000,
    max_heldout_bytes=40_000,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    draft_intermediate_size=128,
    num_draft_steps=3,
    batch_tokens=512,
    short_context=64,
    long_context=128,
    warmup_steps=2,
    target_max_steps=12,
    draft_max_steps=8,
    eval_reserve_s=0.0,
    eval_windows=4,
    chain_prompts=2,
    chain_prompt_len=24,
    chain_new_tokens=16,
)

# head_dim 64 (FlashInfer serves it); 9.9M parameters, 19.8 MB in bf16.
GPU = DemoConfig(
    max_train_bytes=300_000_000,
    extra_sources=True,
    tokenizer_train_bytes=30_000_000,
    hidden_size=320,
    num_heads=5,
    num_kv_heads=1,
    intermediate_size=864,
    draft_intermediate_size=864,
    batch_tokens=65_536,
    warmup_steps=100,
    eval_reserve_s=30.0,
    eval_windows=256,
    chain_prompts=32,
)

# The third: the second run's target as it is (that run's draft stage had been cut short), and
# a new draft for it: `--preset full-draft --init-from RUN2`.
FULL_DRAFT = replace(
    FULL_MORE,
    target_max_steps=0,
    draft_max_steps=1200,
    init_from_name="RUN2",
    lineage="`make-demo RUN1 --preset full` trained it from scratch on the standard library (1800 "
    "steps, 3.69M tokens, 3100 s; held-out 1.618 bits/byte), then `make-demo RUN2 --preset "
    "full-more --init-from RUN1` for 1800 more steps on the standard library and a sample of the "
    "installed packages (3.69M tokens, 2883 s, last training loss 2.658; held-out 1.340 "
    "bits/byte), on this machine's CPU. RUN2 was stopped during its draft stage",
)

PRESETS = {
    "full": FULL,
    "full-more": FULL_MORE,
    "full-draft": FULL_DRAFT,
    "quick": QUICK,
    "gpu": GPU,
}
