"""The demo target fine-tuned on a new domain, for the online-learning bench: a deployment that
adapted its target to its own code while its draft stayed the one trained for the original.

    python -m specmesh.demo.finetune OUT [--domain javascript] [--seconds 300] [--lr 5e-4]
        [--steps N] [--max-mb 20] [--threads 2] [--seed 0]

Trains every weight of the shipped demo target (`specmesh.defaults.default_models`) on the
domain's traffic files of `specmesh.bench.online_data` (its held-out files, the bench's
evaluation prompts, are never read), windows of 256 tokens, 2,048 tokens a step, AdamW with the
demo's schedule (warm-up, cosine to a tenth) for ``--seconds`` (or ``--steps``, whichever
ends first), in fp32 (bf16 autocast on a
GPU). Writes ``OUT`` as a Hugging Face checkpoint in bf16 with the demo's tokenizer and chat
template, and prints the held-out loss on the domain (nats per token) before and after.

    python -m specmesh.bench.online --target-model OUT

then serves it under the shipped draft: the draft's features and labels both moved, the case
online learning is for.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specmesh.bench.online_data import DOMAINS, domain_files
from specmesh.defaults import default_models
from specmesh.demo import data as demo_data
from specmesh.demo.config import DemoConfig
from specmesh.demo.loop import LoopStats, train_timed
from specmesh.demo.progress import Progress
from specmesh.demo.target import load_target_fp32, target_loss
from specmesh.router.tokenizer import load_tokenizer

EVAL_WINDOWS = 32  # held-out windows of 256 tokens


def read_texts(files: list[Path], max_bytes: float) -> list[str]:
    """The files' texts in order, until ``max_bytes`` characters are read."""
    texts, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        try:
            texts.append(path.read_text(errors="ignore"))
        except OSError:
            continue
        size += len(texts[-1])
    return texts


def loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the demo's (bf16 autocast) on a GPU, fp32 on a CPU (which may
    have no native bf16)."""
    if windows.is_cuda:
        return target_loss(model, windows)
    logits = model(input_ids=windows).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor) -> float:
    """Mean loss over evenly spaced windows of ``stream`` (on the host)."""
    windows = demo_data.heldout_windows(stream, EVAL_WINDOWS, 256).to(model.device)
    was_training = model.training
    model.eval()
    value = sum(loss(model, w[None]).item() for w in windows) / len(windows)
    model.train(was_training)
    return value


@dataclass(frozen=True)
class Budget:
    seconds: float = 300.0
    steps: int | None = None  # whichever ends first
    lr: float = 5e-4  # peak
    max_mb: float = 20.0  # traffic text read
    seed: int = 0


def finetune(
    out: Path, domain: str, budget: Budget, device: str = "cpu", root: Path | None = None
) -> tuple[LoopStats, float, float]:
    """Writes the fine-tuned target to ``out``; (loop stats, held-out loss before, after).
    ``root``: the domain's files from there (`online_data.domain_files`; tests)."""
    source = Path(default_models().target)
    tokenizer = load_tokenizer(str(source))
    heldout, traffic = domain_files(domain, root)
    texts = read_texts(traffic, budget.max_mb * 1e6)
    train = demo_data.encode_stream(tokenizer, texts)  # on the host, windows go to the device
    evaluation = demo_data.encode_stream(tokenizer, read_texts(heldout, 2e6))
    torch.manual_seed(budget.seed)
    model = load_target_fp32(source, device).requires_grad_(True).train()
    before = heldout_loss(model, evaluation)
    generator = torch.Generator().manual_seed(budget.seed)
    cfg = replace(DemoConfig(), warmup_steps=20, long_context_from=2.0)  # 256-token windows
    stats = train_timed(
        list(model.parameters()),
        lambda windows: loss(model, windows),
        lambda n, length: demo_data.sample_windows(train, n, length, generator).to(device),
        cfg,
        peak_lr=budget.lr,
        budget_s=budget.seconds,
        max_steps=budget.steps,
        bar=Progress("finetune"),
    )
    after = heldout_loss(model, evaluation)
    shutil.copytree(source, out, dirs_exist_ok=True)  # tokenizer, chat template, configs
    model.eval().to(torch.bfloat16).save_pretrained(out)
    return stats, before, after


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.demo.finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("out", type=Path)
    p.add_argument("--domain", choices=sorted(DOMAINS), default="javascript")
    helps = {"seconds": "training time", "steps": "at most this many optimizer steps",
             "lr": "peak learning rate", "max_mb": "traffic text read, in MB", "seed": "seed"}  # fmt: skip
    for name, field in Budget.__dataclass_fields__.items():
        kind = int if name in ("steps", "seed") else float
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default,
                       help=helps[name])  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = Budget(**{name: getattr(args, name) for name in Budget.__dataclass_fields__})
    stats, before, after = finetune(args.out, args.domain, budget, args.device)
    print(f"{stats.num_steps} steps, {stats.num_tokens} tokens in {stats.seconds:.0f} s; held-out "
          f"{args.domain} loss {before:.3f} -> {after:.3f} nats/token; wrote {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
