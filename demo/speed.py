"""Tokens/s of a demo pair on this machine, with and without speculation, for its model card.

    python -m specmesh.demo.speed PAIR_DIR [--repeats 3] [--card]

The README's prompts (`text.README_PROMPTS`), batch 1, fp32, each request `--max-new-tokens`
tokens (EOS ignored), greedy and sampled: in process and through a local gRPC cluster (target,
draft and router processes, as `specmesh up` runs them), each without speculation and with the
adaptive policy (`--speculation adaptive`, the servers' default). Every (side, repeat) runs in a
fresh process (`specmesh bench`'s worker), the repeats interleaved (the whole plan, then
again); a side reports min / median / max tokens/s and the median run's tokens per round.
``--card`` also writes the table into PAIR_DIR/README.md, in place of its "Speed" section.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmesh.bench.metrics import aggregate
from specmesh.bench.runners import RunSpec
from specmesh.bench.session import WORKER_TIMEOUT_S
from specmesh.bench.spawn import run_worker
from specmesh.bench.suite import interleave
from specmesh.bench.worker import Job
from specmesh.defaults import DEFAULT_SPEC
from specmesh.demo.card import SPEED_SECTION as SECTION
from specmesh.demo.text import README_PROMPTS
from specmesh.protocol.config import SpecParams

SPEC = SpecParams(**DEFAULT_SPEC)  # what `specmesh up` and `generate` run
SAMPLED = 0.7  # the sampled rows' temperature


@dataclass(frozen=True)
class SpeedSettings:
    repeats: int = 3
    max_new_tokens: int = 128
    requests: int = 6  # each README prompt in turn, one at a time
    threads: int = 2  # torch threads of each measured process (a cluster's services: 1 each)


def plan(settings: SpeedSettings) -> list[RunSpec]:
    runs = []
    for temperature in (0.0, SAMPLED):
        for backend in ("inprocess", "cluster"):
            for speculation in (None, "adaptive"):
                spec, kind = (SPEC, "eagle3") if speculation else (None, None)
                runs.append(RunSpec(
                    backend, "readme", 1, temperature, spec, settings.max_new_tokens,
                    settings.requests, "fp32", kind, speculation or "always",
                ))  # fmt: skip
    return runs


def measure(pair_dir: Path, settings: SpeedSettings) -> list[dict[str, Any]]:
    from specmesh.router.tokenizer import load_tokenizer

    target, draft = str(pair_dir / "target"), str(pair_dir / "draft")
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.encode(p, add_special_tokens=True) for p in README_PROMPTS]
    pad = tokenizer.pad_token_id or 0
    worker = [sys.executable, "-m", "specmesh.bench.worker"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for repeat, run in interleave(plan(settings), settings.repeats):
        # A plain cluster run starts the draft service anyway, idle (its requests do not draft).
        job = Job(run, target, draft, {}, settings.threads, prompts, pad, ("eagle3", SPEC))
        res = run_worker(worker, job.to_json(), settings.threads, WORKER_TIMEOUT_S)
        res |= {"repeat": repeat}
        by_name.setdefault(run.name, []).append(res)
        print(f"[speed] {run.name} #{repeat}: {res['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return [aggregate(runs) for runs in by_name.values()]


def render(configs: list[dict[str, Any]], settings: SpeedSettings) -> str:
    rows = []
    for c in configs:
        where = "in process" if c["backend"] == "inprocess" else "gRPC cluster"
        mode = "adaptive" if c["speculative"] else "plain (never)"
        rows.append(
            f"| {where} | {c['temperature']:g} | {mode} | **{c['tokens_per_s']:.1f}** "
            f"({c['tokens_per_s_min']:.1f} - {c['tokens_per_s_max']:.1f}) | "
            f"{c['mean_accept_len']:.2f} |"
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"""{SECTION}

`python -m specmesh.demo.speed PAIR_DIR --card` ({settings.repeats} interleaved repeats, each
side in its own process; {os.cpu_count()} cores, load average {load} when it ended): batch 1,
fp32, the README's prompts in turn, {settings.max_new_tokens} new tokens each, EAGLE-3
{SPEC.num_steps} / {SPEC.topk} / {SPEC.num_draft_tokens} (`specmesh up`'s default). Tokens/s
median (min - max); tokens per round of the median run.

| where | temperature | speculation | tokens/s | tokens per round |
|---|---|---|---|---|
{chr(10).join(rows)}
"""


def write_card_section(card: Path, section: str) -> None:
    """Replace the card's speed section (up to the next heading), or add it before "## Held-out"."""
    text = card.read_text()
    if SECTION in text:
        head, rest = text.split(SECTION, 1)
        tail = rest[rest.find("\n## ") + 1 :] if "\n## " in rest else ""
    else:
        head, tail = text.split("## Held-out", 1)
        tail = "## Held-out" + tail
    card.write_text(head + section + "\n" + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.demo.speed", description=__doc__)
    parser.add_argument("pair_dir", type=Path, metavar="PAIR_DIR")
    parser.add_argument("--repeats", type=int, default=SpeedSettings.repeats)
    parser.add_argument("--max-new-tokens", type=int, default=SpeedSettings.max_new_tokens)
    parser.add_argument("--card", action="store_true", help="write the table into the card")
    args = parser.parse_args(argv)
    settings = SpeedSettings(repeats=args.repeats, max_new_tokens=args.max_new_tokens)
    section = render(measure(args.pair_dir, settings), settings)
    print(section)
    if args.card:
        write_card_section(args.pair_dir / "README.md", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
