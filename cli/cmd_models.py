"""``specmesh make-tiny`` (random tiny checkpoints) and ``specmesh make-demo`` (the trained pair)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specmesh.protocol.config import DRAFT_KINDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random target (and draft) checkpoint")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "deepseek_v3"], default="llama")
    p.add_argument("--draft-kind", choices=DRAFT_KINDS)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_tiny)
    p = sub.add_parser(
        "make-demo", help="train the demo target + EAGLE-3 pair on Python sources (CPU or GPU)"
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-budget", type=float, default=14400.0,
        help="seconds for the whole run, data included: the gpu preset trains until they are "
        "spent, full and quick end on their steps (~2 h on 2 CPU cores for full) or on this cap",
    )  # fmt: skip
    p.add_argument(
        "--preset", choices=["full", "full-more", "full-draft", "quick", "gpu"], default="full",
        help="full: the CPU pair; quick: a seconds-long smoke run; gpu: a larger pair on more text",
    )  # fmt: skip
    p.add_argument(
        "--init-from", metavar="DIR",
        help="an earlier run of the same preset: train its target (and tokenizer) again, then a "
        "new draft (the shipped pair is two runs of full, the second --init-from the first)",
    )  # fmt: skip
    p.add_argument(
        "--quick", dest="preset", action="store_const", const="quick", help="= --preset quick"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(run=run_demo)


def run_tiny(args: argparse.Namespace) -> int:
    from specmesh.runtime.tiny import make_tiny_deepseek, make_tiny_target
    from specmesh.runtime.tiny_drafts import make_tiny_draft

    out = Path(args.out_dir)
    own_nextn = args.arch == "deepseek_v3" and args.draft_kind == "mtp"
    if args.arch == "deepseek_v3":  # with a NextN layer when it is the MTP draft
        target = make_tiny_deepseek(out / "target", seed=args.seed, nextn=own_nextn)
    else:
        target = make_tiny_target(out / "target", arch=args.arch, seed=args.seed)
    paths = {"target": str(target)}
    if own_nextn:
        paths["draft"] = str(target)  # --draft-model is the DeepSeek checkpoint itself
    elif args.draft_kind and args.draft_kind != "ngram":
        paths["draft"] = str(
            make_tiny_draft(out / "draft", out / "target", args.draft_kind, seed=args.seed)
        )
    print(json.dumps(paths))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specmesh.demo import make_demo

    report = make_demo(
        Path(args.out_dir), seed=args.seed, time_budget_s=args.time_budget,
        preset=args.preset, device=args.device, init_from=args.init_from,
    )  # fmt: skip
    print(json.dumps(asdict(report), indent=1))
    return 0
