"""`DemoReport` (what a demo run measured) and the model card rendered from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.demo.config import DemoConfig
from specmesh.demo.corpus import EVAL_ONLY_PACKAGES, SourceStats

SPEED_SECTION = "## Speed on this machine"  # `demo.speed --card` replaces this section

CARD_PACKAGES = 30  # installed packages listed by name on the card, largest first


@dataclass(frozen=True)
class DemoReport:
    out_dir: str
    preset: str  # a key of config.PRESETS
    seed: int
    time_budget_s: float
    total_seconds: float
    device: str  # "cpu" or "cuda"
    device_name: str  # e.g. "CPU (2 threads)", "NVIDIA H100 80GB HBM3"
    init_from: str | None  # the earlier run whose target this one trained further
    # Data (set by the corpus / tokenizer stage).
    python_version: str
    data_seconds: float  # corpus read + tokenizer + encoding
    sources: list[SourceStats]  # stdlib train / held out (+ installed packages / eval-only)
    package_bytes: list[tuple[str, int]]  # training bytes per installed top-level package
    num_train_files: int
    num_heldout_files: int
    train_bytes: int
    heldout_bytes: int
    train_tokens: int  # bos + file + eos, per file
    heldout_tokens: int
    eval_only_tokens: int  # 0 without extra sources
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
    target_eval_bits_per_byte: float  # the same windows: nats / UTF-8 bytes / ln 2
    eval_only_loss: float | None  # nats/token on the eval-only text (extra sources only)
    eval_only_bits_per_byte: float | None
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
    # The target's greedy continuations of the README's prompts (`text.greedy_continuations`):
    # (prompt, text, back-to-back copies of its most repeated n-gram).
    readme_continuations: list[tuple[str, str, int]]


def _pct(values: list[float]) -> str:
    return ", ".join(f"{v * 100:.1f}%" for v in values)


def _size_table(r: DemoReport, c: DemoConfig) -> str:
    return f"""| | target | draft |
|---|---|---|
| layers | {c.num_layers} | 1 |
| hidden / intermediate | {c.hidden_size} / {c.intermediate_size} | {c.hidden_size} / {c.draft_intermediate_size} |
| heads / KV heads / head dim | {c.num_heads} / {c.num_kv_heads} / {c.head_dim} | same |
| vocab | {r.vocab_size} | {r.draft_vocab_size} (hot) |
| RoPE base | {c.rope_theta:g} | {c.draft_rope_theta:g} |
| context (trained) | {c.short_context}, last {(1 - c.long_context_from) * 100:.0f}% at {c.long_context} | same |
| parameters | {r.target_params:,} | {r.draft_params:,} (+ target embedding) |
| bf16 safetensors | {r.target_mb:.2f} MB | {r.draft_mb:.2f} MB |"""


def _command(r: DemoReport, c: DemoConfig) -> str:
    """The run's command; an earlier run it started from by the name the card gives it (its
    path was the machine's own)."""
    flags = (
        f"--preset {r.preset} --device {r.device} --time-budget {r.time_budget_s:g} --seed {r.seed}"
    )
    init = "" if r.init_from is None else f" --init-from {c.init_from_name}"
    init_arg = "" if r.init_from is None else f", init_from={c.init_from_name!r}"
    return (
        f"specmesh make-demo OUT_DIR {flags}{init}\n    # == specmesh.demo.make_demo(OUT_DIR, "
        f"seed={r.seed}, time_budget_s={r.time_budget_s:g}, preset={r.preset!r}, device={r.device!r}"
        f"{init_arg})"
    )


def _sources_text(r: DemoReport, c: DemoConfig) -> str:
    rows = "\n".join(f"| {s.name} | {s.num_files:,} | {s.num_bytes:,} |" for s in r.sources)
    text = f"""| source | files | bytes |
|---|---|---|
{rows}"""
    if not c.extra_sources:
        return text
    eval_only = ", ".join(f"`{name}`" for name in sorted(EVAL_ONLY_PACKAGES))
    shown = r.package_bytes[:CARD_PACKAGES]
    rest = r.package_bytes[CARD_PACKAGES:]
    packages = ", ".join(f"`{name}` {num_bytes / 1e6:.2f}" for name, num_bytes in shown)
    if rest:
        packages += f", and {len(rest)} more ({sum(b for _, b in rest) / 1e6:.2f})"
    cap = "no cap" if c.max_train_bytes is None else f"a cap of {c.max_train_bytes / 1e6:g} MB"
    return f"""Also the `.py` files of the installed packages (site-packages, same exclusions),
under {cap} for all training text, files taken in path-hash order.
{eval_only} stay out of training: a path-hash sample of them (up to
{c.max_eval_only_bytes / 1e6:g} MB) is the eval-only text. A training file equal in content
(sha256) to a held-out or eval-only file, or to an earlier training file, is dropped.

{text}

Installed packages in the training text (MB): {packages}."""


def _continuations(r: DemoReport) -> str:
    """Each README prompt and what the target wrote after it (greedy, fp32)."""
    fence = "`" * 3
    return "\n\n".join(
        f"{prompt!r} (at most {repeats} back-to-back copies of one n-gram):\n\n"
        f"{fence}python\n{prompt}{text.replace(fence, chr(39) * 3)}\n{fence}"
        for prompt, text, repeats in r.readme_continuations
    )


def _target_training(r: DemoReport, c: DemoConfig, schedule: str) -> str:
    """The card's target bullet: this run's steps, after the run it started from if any."""
    lineage = f" ({c.lineage})" if c.lineage else ""
    if r.init_from is not None and r.target_steps == 0:
        return f"- Target: the target of `{c.init_from_name}`{lineage}, not trained further in this run."
    origin = (
        ""
        if r.init_from is None
        else f"the target of `{c.init_from_name}`{lineage} trained again: "
    )
    return f"""- Target: {origin}{r.target_steps} AdamW steps of {c.batch_tokens} tokens ({r.target_train_tokens:,} in all,
  {r.target_seconds:.0f} s), random windows of the training files concatenated as
  `<|bos|>` file `<|eos|>`, peak lr {c.target_lr:g}, warm-up then cosine over {schedule},
  bf16 autocast; last training loss {r.target_train_loss:.3f}."""


def _trained_on(r: DemoReport) -> str:
    """How much text the target saw, for the card's opening."""
    if r.init_from is None:
        return f"trained from scratch on {r.target_train_tokens / 1e6:.1f}M tokens of Python"
    if r.target_steps == 0:
        return "trained by the earlier runs under Training"
    return (
        f"trained on {r.target_train_tokens / 1e6:.1f}M more tokens of Python after an earlier run"
    )


def _steps_note(cfg: DemoConfig) -> str:
    if cfg.target_max_steps is None or cfg.draft_max_steps is None:
        return "The number of steps depends on the machine's speed (the schedule follows the time budget)."  # fmt: skip
    stages = f"Each stage runs {cfg.target_max_steps} and {cfg.draft_max_steps} steps"
    if cfg.target_max_steps == 0:
        stages = f"The draft stage runs {cfg.draft_max_steps} steps"
    return f"{stages} (the time budget only caps them): a busy machine makes the run longer, not the pair worse."  # fmt: skip


def render_card(report: DemoReport, cfg: DemoConfig, heldout_files: list[str]) -> str:
    r, c = report, cfg
    heldout = "\n".join(f"- `{p}`" for p in heldout_files)
    by_steps = cfg.target_max_steps is not None and cfg.draft_max_steps is not None
    schedule = "the run's steps" if by_steps else "the time budget"
    steps_note = _steps_note(cfg)
    tokenizer_text = (
        "all training text"
        if cfg.tokenizer_train_bytes is None
        else f"a {cfg.tokenizer_train_bytes / 1e6:g} MB path-hash sample of the training text"
    )
    eval_only = (
        ""
        if r.eval_only_loss is None or r.eval_only_bits_per_byte is None
        else f"""
- Target on the eval-only text ({r.eval_only_tokens:,} tokens, {cfg.eval_windows} windows):
  **{r.eval_only_loss:.3f} nats/token, {r.eval_only_bits_per_byte:.3f} bits/byte**."""
    )
    eval_only_tokens = f", {r.eval_only_tokens:,} eval-only" if r.eval_only_tokens else ""
    return f"""# specmesh demo pair: a tiny Python-code Llama and its EAGLE-3 draft

Trained on {r.device_name} by `specmesh.demo.make_demo`, preset `{r.preset}`.
For exercising the serving system end to end (target, EAGLE-3 draft, tree verification)
without downloads.

    {_command(r, c)}

What to expect of a model this small ({r.target_params / 1e6:.1f}M parameters, {_trained_on(r)}):
it continues Python in the style of what it read (docstrings with sections, `if` / `return`,
`os.path` calls) and keeps indentation mostly right, but it does not know what a name means
(`def read_lines(path):` gets a docstring and a body, not code that reads lines), and it
repeats itself: greedy decoding loops on many prompts (`import os` and a newline gives `import
os` over and over, below), which is why the README's examples use prompts where it does not.
Sampling (temperature 0.7, top-p 0.95) loops less and reads as Python-shaped text, not
programs. Greedy text is the most predictable, so speculation accepts most there; sampled, the
draft agrees less and the adaptive policy mostly decodes plainly on a CPU (the speed table).

Traded for speculation on a CPU: the target is {c.num_layers} layers deep ({r.target_mb:.1f} MB in
bf16, of the ~20 MB the repository holds for the pair), since a forward of these sizes costs
about the same per layer whatever the width, so depth is what makes the one-layer draft cheap
beside it; the price is a slower plain step. Less repetitive text is also harder to predict:
the draft accepts less than it did beside the earlier, loopier 8-layer target.

## Files

- `target/`: `LlamaForCausalLM`, bf16 safetensors, **tied** input/output embeddings (no
  `lm_head.weight` tensor), byte-level BPE tokenizer (`AutoTokenizer`; encoding prepends
  `<|bos|>`; `<|eos|>` ends each training file), `generation_config.json` with eos,
  `chat_template.jinja` (each message a `# role:` comment line then its text; the answer
  opens with `# assistant:`, for /v1/chat/completions).
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

{_sources_text(r, cfg)}

Tokens: {r.train_tokens:,} train, {r.heldout_tokens:,} held out{eval_only_tokens};
data ready in {r.data_seconds:.0f} s. Vocabulary {r.vocab_size}: byte-level BPE learned from
{tokenizer_text}, `<|bos|>`=0, `<|eos|>`=1, `<|pad|>`=2; the draft's hot vocabulary covers
{r.hot_vocab_coverage * 100:.1f}% of training tokens.

## Training (seed {r.seed}, {r.total_seconds:.0f} s in all)

{_target_training(r, c, schedule)}
- Draft: {r.draft_steps} steps, {r.draft_train_tokens:,} tokens, {r.draft_seconds:.0f} s;
  training-time test over {len(r.draft_step_accuracy)} steps (step j weighted
  {cfg.step_loss_decay:g}^j), peak lr {cfg.draft_lr:g},
  cross-entropy against the frozen bf16 target's greedy next token; last loss
  {r.draft_train_loss:.3f}.

{steps_note}

## Results

- Target on the held-out files ({cfg.eval_windows} windows of {cfg.short_context} tokens):
  **{r.target_eval_loss:.3f} nats/token** (perplexity {math.exp(r.target_eval_loss):.1f}),
  **{r.target_eval_bits_per_byte:.3f} bits/byte** (comparable across tokenizers).{eval_only}
- Draft top-1 agreement with the target's greedy token, teacher-forced, per step:
  {_pct(r.draft_step_accuracy)}.
- Greedy chain speculation simulated on the target's own greedy continuations
  ({r.chain_rounds} round starts, chain depth {len(r.chain_conditional_acceptance)}):
  per-step acceptance given the earlier steps accepted {_pct(r.chain_conditional_acceptance)};
  mean accepted length **{r.chain_mean_accept_length:.2f} tokens per target forward** (drafts
  accepted + the target's bonus token).

`python -m specmesh.demo.compare PAIR_DIR ...` measures pairs side by side on the held-out
files of the running Python.

## Greedy continuations of the README's prompts (the last two: prompts it no longer uses)

{_continuations(r)}

{SPEED_SECTION}

Not measured yet: `python -m specmesh.demo.speed PAIR_DIR --card` writes it here.

## Held-out files ({r.num_heldout_files})

{heldout}
"""
