"""What online learning costs the cluster, and what it gives back, one core standing in for each
device (as `specmesh bench --pin` places a cluster):

    python -m specmesh.bench.online_speed --learned DIR/latest [--out DIR] [--repeats 3]
        [--batch 8] [--domain javascript] [--target-model DIR]

Three drafts behind the same cluster (target on core 0; draft, router and the client on core
1), each (configuration, temperature, repeat) a fresh `bench.worker` process, repeats
interleaved:

    learning off          the shipped demo draft
    learning on           the same with ``--online-learning``: a deployment's start
    learned, learning on  ``--model LEARNED`` with ``--online-learning``: the head the learner
                          wrote after serving the new domain (`bench.online
                          --online-learning-dir DIR`; DIR/latest), still learning

on the new domain's held-out prompts (`bench.online_data`, never trained on), greedy and at
temperature 0.8, fp32, EAGLE-3 5 / 4 / 8, ``--speculation always``. Prints tokens/s (median,
min - max), each configuration's ratio to learning off at the same temperature, and the
accept length. Needs two CPUs. Writes ``OUT/online_speed.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from specmesh.bench.hop import WORKER, WORKER_TIMEOUT_S
from specmesh.bench.metrics import aggregate, ratio_spread, speed_row
from specmesh.bench.online_data import DOMAINS, domain_files, eval_prompts
from specmesh.bench.report import write_json
from specmesh.bench.runners import RunSpec
from specmesh.bench.spawn import run_worker
from specmesh.bench.suite import interleave
from specmesh.bench.worker import TWO_DEVICES, Job
from specmesh.defaults import default_models
from specmesh.protocol.config import SpecParams

SPEC = SpecParams(num_steps=5, topk=4, num_draft_tokens=8)
PROMPT_LEN, MAX_NEW_TOKENS, TEMPERATURES = 64, 128, (0.0, 0.8)
OFF = "learning off"


def plan(
    learned: Path, batch: int, num_requests: int, target: str | None = None
) -> list[tuple[str, Job]]:
    """(label, job template) per configuration and temperature; prompts are filled in later.
    ``target``: another target than the demo's (`bench.online --target-model`)."""
    models = default_models()
    target = target or models.target
    on = ["--online-learning"]
    out = []
    for temp in TEMPERATURES:
        run = RunSpec("cluster", "domain", batch, temp, SPEC, MAX_NEW_TOKENS, num_requests,
                      "fp32", models.draft_kind)  # fmt: skip
        for label, draft, extra in [
            (OFF, models.draft, []),
            ("learning on", models.draft, on),
            ("learned, learning on", str(learned), on),
        ]:
            job = Job(run, target, draft, {}, 1, [], 0, cpus=TWO_DEVICES, draft_args=extra)
            out.append((f"t{temp:g} {label}", job))
    return out


def measure(configs: list[tuple[str, Job]], prompts: list[list[int]], pad: int, repeats: int):
    runs: dict[str, list[dict[str, Any]]] = {}
    order = interleave(list(range(len(configs))), repeats)
    for i, (repeat, index) in enumerate(order):
        label, job = configs[index]
        job = Job(**{**job.__dict__, "prompts": prompts, "pad_token_id": pad})
        res = run_worker(WORKER, job.to_json(), 1, WORKER_TIMEOUT_S)
        runs.setdefault(label, []).append(res | {"repeat": repeat, "label": label})
        print(f"[online_speed {i + 1}/{len(order)}] {label}: {res['tokens_per_s']:.1f} tok/s, "
              f"accept {res['mean_accept_len']:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    return [aggregate(r) | {"label": label} for label, r in runs.items()]


def compare(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration over learning off at the same temperature."""
    off = {c["label"].split()[0]: c for c in configs if c["label"].endswith(OFF)}
    return [
        {"label": c["label"], **ratio_spread(c["tokens_per_s_runs"],
                                             off[c["label"].split()[0]]["tokens_per_s_runs"])}
        for c in configs if not c["label"].endswith(OFF)
    ]  # fmt: skip


def format_table(configs: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> str:
    ratios = {c["label"]: c for c in comparisons}
    lines = [
        "| temperature, draft | tok/s median (min - max) | / learning off (min - max) | "
        "tokens/round |",
        "|---|---|---|---|",
    ]
    lines += [speed_row(c, ratios.get(c["label"])) for c in configs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specmesh.router.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="python -m specmesh.bench.online_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--learned", type=Path, required=True, metavar="DIR",
                   help="a learned checkpoint (an --online-learning-dir's latest)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results/online"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="requests in flight")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts served per run")
    p.add_argument("--domain", choices=sorted(DOMAINS), default="javascript")
    p.add_argument("--target-model", metavar="DIR",
                   help="the target the learned head was learned under (`bench.online "
                   "--target-model`; default: the demo's)")  # fmt: skip
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench.online_speed needs two CPUs: one stands in for each device")
    if not (args.learned / "config.json").is_file():
        raise SystemExit(f"--learned {args.learned}: no checkpoint there (no config.json)")
    configs = plan(args.learned.resolve(), args.batch, args.prompts, args.target_model)
    tokenizer = load_tokenizer(default_models().target)
    held, _ = domain_files(args.domain)
    prompts = eval_prompts(tokenizer, held, args.prompts, PROMPT_LEN)
    results = measure(configs, prompts, tokenizer.pad_token_id or 0, args.repeats)
    comparisons = compare(results)
    write_json({"configs": results, "comparisons": comparisons, "learned": str(args.learned),
                "domain": args.domain, "target": args.target_model}, args.out / "online_speed.json")  # fmt: skip
    print(format_table(results, comparisons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
