"""Demo pairs side by side on the held-out stdlib files of the running Python.

    python -m specmesh.demo.compare PAIR_DIR [PAIR_DIR ...] [--device cpu] [--out FILE.json]

For each pair (`target/` and `draft/`, as `make_demo` writes them), on the same text:

- the target's bits/byte: the held-out files (path-hash split, as in training; capped at
  `max_bytes`) in the pair's own tokenizer, as one `<|bos|>` file `<|eos|>` stream cut into
  windows of the model's context that overlap by one token, so every token is predicted once;
  the summed loss over the UTF-8 bytes of the files does not depend on the tokenizer;
- greedy chain speculation (`draft_train.chain_acceptance`) from prompts made of the first
  `prompt_len` tokens of evenly spaced held-out files, the same files for every pair;
- the target's greedy continuations of the README's prompts: the most back-to-back copies of
  one n-gram in each (`text.longest_repeat`; the shipped pair stays within `text.MAX_REPEATS`).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from specmesh.demo.corpus import TextSet, read_files, split_stdlib
from specmesh.demo.data import covering_windows, encode_stream, token_byte_lengths
from specmesh.demo.draft_train import aux_layer_ids, chain_acceptance
from specmesh.demo.eagle3 import load_draft
from specmesh.demo.target import HeldoutLoss, eval_loss, load_target_fp32
from specmesh.demo.text import greedy_continuations

MIN_PROMPT_FILE_BYTES_PER_TOKEN = 16  # a prompt file has at least this many bytes per token


@dataclass(frozen=True)
class CompareSettings:
    heldout_percent: int = 5  # as in training (DemoConfig.heldout_percent)
    max_files: int | None = None  # first held-out files (sorted) considered
    max_bytes: int = 200_000  # held-out text scored for bits/byte
    chain_prompts: int = 12  # evenly spaced held-out files, one prompt each
    prompt_len: int = 64  # tokens, `<|bos|>` included
    new_tokens: int = 48  # greedy continuation simulated per prompt
    depth: int = 4  # chain length
    batch_size: int = 8  # windows per forward


@dataclass(frozen=True)
class PairScore:
    pair_dir: str
    vocab_size: int
    target_params: int
    context: int  # window length of the bits/byte pass (max_position_embeddings)
    num_tokens: int  # predicted tokens
    num_bytes: int  # UTF-8 bytes of the scored files
    nats_per_token: float
    bits_per_byte: float
    chain_conditional_acceptance: list[float]  # P(step j accepted | earlier steps accepted)
    chain_mean_accept_length: float  # tokens per target forward
    chain_rounds: int
    readme_repeats: list[int]  # per README prompt: back-to-back copies of one n-gram, greedy
    seconds: float


def heldout_text(settings: CompareSettings, stdlib_dir: Path | None = None) -> TextSet:
    stdlib_dir = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    held, _ = split_stdlib(stdlib_dir, settings.heldout_percent)
    return read_files(held[: settings.max_files], settings.max_bytes)


def prompt_texts(text: TextSet, settings: CompareSettings) -> list[str]:
    """Evenly spaced files long enough for a prompt in any byte-level tokenizer."""
    min_bytes = MIN_PROMPT_FILE_BYTES_PER_TOKEN * settings.prompt_len
    long_enough = [t for t in text.texts if len(t.encode()) >= min_bytes]
    count = min(settings.chain_prompts, len(long_enough))
    if count == 0:
        raise ValueError(f"no held-out file has {min_bytes} bytes for a prompt")
    return [long_enough[i * len(long_enough) // count] for i in range(count)]


@torch.no_grad()
def score_pair(
    pair_dir: Path, text: TextSet, prompts: list[str], settings: CompareSettings, device: str
) -> PairScore:
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(pair_dir / "target")
    target = load_target_fp32(pair_dir / "target", device)
    draft = load_draft(pair_dir / "draft").to(device)
    num_layers, context = target.config.num_hidden_layers, target.config.max_position_embeddings
    saved_ids = json.loads((pair_dir / "draft" / "config.json").read_text())["eagle_config"]
    if saved_ids["eagle_aux_hidden_state_layer_ids"] != aux_layer_ids(num_layers):
        raise ValueError(f"{pair_dir}: the draft taps other layers than make_demo's")
    if settings.prompt_len + settings.new_tokens > context:
        raise ValueError(f"prompt_len + new_tokens must fit the context {context}")

    byte_lengths = token_byte_lengths(tokenizer).to(device)
    stream = encode_stream(tokenizer, text.texts).to(device)
    loss = HeldoutLoss(0.0, 0, 0)
    for windows in covering_windows(stream, context):
        loss = loss + eval_loss(target, windows, byte_lengths, settings.batch_size)
    if loss.num_bytes != text.num_bytes:
        raise ValueError(
            f"{pair_dir}: tokens decode to {loss.num_bytes} bytes, not {text.num_bytes}"
        )

    prompt_ids = [encode_stream(tokenizer, [p])[: settings.prompt_len] for p in prompts]
    if min(ids.numel() for ids in prompt_ids) < settings.prompt_len:
        raise ValueError(f"{pair_dir}: a prompt file is shorter than {settings.prompt_len} tokens")
    prompt_batch = torch.stack(prompt_ids).to(device)  # [num_prompts, prompt_len]
    chain = chain_acceptance(draft, target, prompt_batch, settings.new_tokens, settings.depth)
    readme = [c.repeat.count for c in greedy_continuations(str(pair_dir / "target"))]
    return PairScore(
        str(pair_dir), len(tokenizer), sum(p.numel() for p in target.parameters()), context,
        loss.num_tokens, loss.num_bytes, loss.nats_per_token, loss.bits_per_byte,
        chain.conditional_acceptance, chain.mean_accept_length, chain.num_rounds, readme,
        time.monotonic() - start,
    )  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    python_version: str
    settings: CompareSettings
    heldout_files: list[str]  # the scored files, relative to the stdlib
    heldout_bytes: int
    pairs: list[PairScore]


def compare(pair_dirs: list[Path], settings: CompareSettings, device: str = "cpu") -> Comparison:
    """Every pair scored on the same held-out text."""
    text = heldout_text(settings)
    prompts = prompt_texts(text, settings)
    scores = [score_pair(Path(d), text, prompts, settings, device) for d in pair_dirs]
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Comparison(version, settings, text.files, text.num_bytes, scores)


def render_table(comparison: Comparison) -> str:
    lines = [
        f"{'pair':<32} {'vocab':>6} {'params':>8} {'bits/byte':>9} {'nats/tok':>8} "
        f"{'accept':>6} {'loops':>5}  per-step acceptance"
    ]
    for s in comparison.pairs:
        steps = ", ".join(f"{a * 100:.1f}%" for a in s.chain_conditional_acceptance)
        lines.append(
            f"{s.pair_dir[-32:]:<32} {s.vocab_size:>6} {s.target_params / 1e6:>7.2f}M "
            f"{s.bits_per_byte:>9.4f} {s.nats_per_token:>8.4f} "
            f"{s.chain_mean_accept_length:>6.2f} {max(s.readme_repeats):>5}  {steps}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.demo.compare", description=__doc__)
    parser.add_argument("pair_dirs", nargs="+", type=Path, metavar="PAIR_DIR")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    for field in fields(CompareSettings):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=int, default=field.default, dest=field.name)
    args = parser.parse_args(argv)
    settings = CompareSettings(**{f.name: getattr(args, f.name) for f in fields(CompareSettings)})
    hf_logging.disable_progress_bar()  # transformers' loading bars
    comparison = compare(args.pair_dirs, settings, args.device)
    print(render_table(comparison))
    payload = json.dumps(asdict(comparison), indent=1)
    print(payload)
    if args.out:
        args.out.write_text(payload + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
