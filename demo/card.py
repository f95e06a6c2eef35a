"""`DemoReport` (what a demo run measured) and the model card rendered from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.demo.config import DemoConfig


@dataclass(frozen=True)
class DemoReport:
    out_dir: str
    quick: bool
    seed: int
    time_budget_s: float
    total_seconds: float
    num_cpu_threads: int  # torch intra-op threads
    # Data (set by the corpus / tokenizer stage).
    python_version: str
    num_train_files: int
    num_heldout_files: int
    train_bytes: int
    heldout_bytes: int
    train_tokens: int  # bos + file + eos, per file
    heldout_tokens: int
    vocab_size: int
    draft_vocab_size: int
    hot_vocab_coverage: float  # share of training tokens inside the draft's hot vocabulary
    # Target (set after its training).
    target_params: int  # tied embedding counted once
    target_mb: float  # model.safetensors on disk
    target_steps: int
    target_train_tokens: int
    target_seconds: float
    target_train_loss: float  # nats/token, moving average at the end
    target_eval_loss: float  # nats/token on held-out files, bf16 weights computed in fp32
    # Draft (set after its training).
    draft_params: int
    draft_mb: float
    aux_layer_ids: list[int]  # output-of-layer convention
    draft_steps: int
    draft_train_tokens: int
    draft_seconds: float
    draft_train_loss: float
    draft_step_accuracy: list[float]  # teacher-forced top-1 vs target greedy, per step
    chain_conditional_acceptance: list[float]  # greedy chain, per step, given earlier accepted
    chain_mean_accept_length: float  # tokens per target forward, chain of num_draft_steps
    chain_rounds: int

    @property
    def target_eval_bits_per_byte(self) -> float:
        return self.target_eval_loss * self.heldout_tokens / self.heldout_bytes / math.log(2)


def _pct(values: list[float]) -> str:
    return ", ".join(f"{v * 100:.1f}%" for v in values)


def _size_table(r: DemoReport, c: DemoConfig) -> str:
    return f"""| | target | draft |
|---|---|---|
| layers | {c.num_layers} | 1 |
| hidden / intermediate | {c.hidden_size} / {c.intermediate_size} | {c.hidden_size} / {c.draft_intermediate_size} |
| heads / KV heads / head dim | {c.num_heads} / {c.num_kv_heads} / {c.hidden_size // c.num_heads} | same |
| vocab | {r.vocab_size} | {r.draft_vocab_size} (hot) |
| RoPE base | {c.rope_theta:g} | {c.draft_rope_theta:g} |
| context (trained) | {c.short_context}, last {(1 - c.long_context_from) * 100:.0f}% at {c.long_context} | same |
| parameters | {r.target_params:,} | {r.draft_params:,} (+ target embedding) |
| bf16 safetensors | {r.target_mb:.2f} MB | {r.draft_mb:.2f} MB |"""


def render_card(report: DemoReport, cfg: DemoConfig, heldout_files: list[str]) -> str:
    r = report
    mode = "a quick, test-sized" if r.quick else "the full"
    command = (
        f"specmesh make-demo OUT_DIR   # == specmesh.demo.make_demo(OUT_DIR, seed={r.seed}, "
        f"time_budget_s={r.time_budget_s:g}{', quick=True' if r.quick else ''})"
    )
    heldout = "\n".join(f"- `{p}`" for p in heldout_files)
    return f"""# specmesh demo pair: a tiny Python-code Llama and its EAGLE-3 draft

Trained from scratch on CPU ({r.num_cpu_threads} threads) by `specmesh.demo.make_demo`, {mode} run.
For exercising the serving system end to end (target, EAGLE-3 draft, tree verification)
without downloads; it writes plausible Python, not good Python.

    {command}

## Files

- `target/`: `LlamaForCausalLM`, bf16 safetensors, **tied** input/output embeddings (no
  `lm_head.weight` tensor), byte-level BPE tokenizer (`AutoTokenizer`; encoding prepends
  `<|bos|>`; `<|eos|>` ends each training file), `generation_config.json` with eos.
- `draft/`: EAGLE-3 draft, `LlamaForCausalLMEagle3` (SpecForge/SGLang layout): `fc`,
  `midlayer.*`, `norm`, `lm_head` over a hot vocabulary of {r.draft_vocab_size} ids, `d2t`
  (target = draft + d2t[draft]), `t2d`; no `embed_tokens` (taken from the target).
  `eagle_aux_hidden_state_layer_ids` = {r.aux_layer_ids} in the **output-of-layer** convention
  (= inputs of target layers {[i + 1 for i in r.aux_layer_ids]}, = `output_hidden_states`
  indices {[i + 1 for i in r.aux_layer_ids]}). The draft's RoPE base differs from the target's
  on purpose: build it from the draft's own config.
- `heldout_files.txt`: the held-out stdlib files (relative paths).

## Sizes

{_size_table(r, cfg)}

## Data

Python {r.python_version} standard library `.py` files (no `site-packages`, tests, `idlelib`,
`encodings`, `pydoc_data`), split by a hash of the relative path.

| | files | bytes | tokens |
|---|---|---|---|
| train | {r.num_train_files} | {r.train_bytes:,} | {r.train_tokens:,} |
| held out | {r.num_heldout_files} | {r.heldout_bytes:,} | {r.heldout_tokens:,} |

Vocabulary {r.vocab_size} (byte-level BPE, `<|bos|>`=0, `<|eos|>`=1, `<|pad|>`=2); the draft's
hot vocabulary covers {r.hot_vocab_coverage * 100:.1f}% of training tokens.

## Training (seed {r.seed}, {r.total_seconds:.0f} s in all)

- Target: {r.target_steps} AdamW steps of {cfg.batch_tokens} tokens ({r.target_train_tokens:,} in all,
  {r.target_seconds:.0f} s), random windows of the training files concatenated as
  `<|bos|>` file `<|eos|>`, peak lr {cfg.target_lr:g}, warm-up then cosine over the time
  budget, bf16 autocast; last training loss {r.target_train_loss:.3f}.
- Draft: {r.draft_steps} steps, {r.draft_train_tokens:,} tokens, {r.draft_seconds:.0f} s;
  training-time test over {len(r.draft_step_accuracy)} steps (step j weighted
  {cfg.step_loss_decay:g}^j), peak lr {cfg.draft_lr:g},
  cross-entropy against the frozen bf16 target's greedy next token; last loss
  {r.draft_train_loss:.3f}.

The number of steps depends on the machine's speed (the schedule follows the time budget).

## Results (held-out files)

- Target eval loss: **{r.target_eval_loss:.3f} nats/token** (perplexity
  {math.exp(r.target_eval_loss):.1f}, about {r.target_eval_bits_per_byte:.2f} bits/byte).
- Draft top-1 agreement with the target's greedy token, teacher-forced, per step:
  {_pct(r.draft_step_accuracy)}.
- Greedy chain speculation simulated on the target's own greedy continuations
  ({r.chain_rounds} round starts, chain depth {len(r.chain_conditional_acceptance)}):
  per-step acceptance given the earlier steps accepted {_pct(r.chain_conditional_acceptance)};
  mean accepted length **{r.chain_mean_accept_length:.2f} tokens per target forward** (drafts
  accepted + the target's bonus token).

## Held-out files ({r.num_heldout_files})

{heldout}
"""
