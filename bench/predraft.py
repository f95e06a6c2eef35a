"""Does the split pay? The demo pair with EAGLE-3, one core standing in for each device:

    python -m specmesh.bench.predraft [--out DIR] [--repeats 3] [--predraft 4] [--batch 1 8]

Three configurations per batch size, each (configuration, repeat) in a fresh `bench.worker`
process, repeats interleaved:

    in process      target and draft share core 0 (one device)
    cluster         target on core 0; draft, router and the client on core 1 (two devices)
    cluster+ahead   the same, the draft pre-drafting (``--predraft N``)

fp32, greedy, held-out code prompts, ``--speculation always`` everywhere (every round verifies
the draft's full tree, so the sides differ only in where the work runs). Prints tokens/s (median,
min - max), each cluster's ratio to in process, acceptance, the pre-draft hit rate and the time a
round waited on the draft. Needs at least two CPUs. Writes ``OUT/predraft.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from specmesh.bench.hop import WORKER, WORKER_TIMEOUT_S
from specmesh.bench.metrics import aggregate, ratio_spread, speed_row
from specmesh.bench.report import write_json
from specmesh.bench.runners import RunSpec
from specmesh.bench.spawn import run_worker
from specmesh.bench.suite import interleave
from specmesh.bench.worker import ONE_DEVICE, TWO_DEVICES, Job
from specmesh.defaults import default_models
from specmesh.protocol.config import SpecParams

SPEC = SpecParams(num_steps=5, topk=4, num_draft_tokens=8)
PROMPT_LEN, MAX_NEW_TOKENS = 64, 128


def plan(batch_sizes: list[int], predraft: int) -> list[tuple[str, RunSpec, Job]]:
    """(label, run, job template) per configuration; prompts are filled in later."""
    models = default_models()
    out = []
    for bs in batch_sizes:
        num_requests = max(8, 2 * bs)
        for backend, label, cpus, extra in [
            ("inprocess", "in process", ONE_DEVICE, []),
            ("cluster", "cluster", TWO_DEVICES, []),
            ("cluster", f"cluster+ahead{predraft}", TWO_DEVICES, ["--predraft", str(predraft)]),
        ]:
            run = RunSpec(backend, "code", bs, 0.0, SPEC, MAX_NEW_TOKENS, num_requests, "fp32",
                          models.draft_kind)  # fmt: skip
            job = Job(run, models.target, models.draft, {}, 1, [], 0, cpus=cpus, draft_args=extra)
            out.append((f"b{bs} {label}", run, job))
    return out


def measure(batch_sizes: list[int], predraft: int, repeats: int) -> list[dict[str, Any]]:
    from specmesh.bench.workloads import load_workload
    from specmesh.router.tokenizer import load_tokenizer

    configs = plan(batch_sizes, predraft)
    tokenizer = load_tokenizer(configs[0][2].target)
    pad = tokenizer.pad_token_id or 0
    runs: dict[str, list[dict[str, Any]]] = {}
    order = interleave(list(range(len(configs))), repeats)
    for i, (repeat, index) in enumerate(order):
        label, run, job = configs[index]
        prompts = load_workload("code", tokenizer, run.num_requests, PROMPT_LEN).prompts
        job = Job(**{**job.__dict__, "prompts": prompts, "pad_token_id": pad})
        res = run_worker(WORKER, job.to_json(), 1, WORKER_TIMEOUT_S)
        runs.setdefault(label, []).append(res | {"repeat": repeat, "label": label})
        print(f"[predraft {i + 1}/{len(order)}] {label}: {res['tokens_per_s']:.1f} tok/s, "
              f"accept {res['mean_accept_len']:.2f}, hits {res['predraft_hit_rate']:.2f}",
              file=sys.stderr, flush=True)  # fmt: skip
    return [aggregate(r) | {"label": label} for label, r in runs.items()]


def compare(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cluster configuration over in process at the same batch size."""
    local = {c["label"].split()[0]: c for c in configs if c["label"].endswith("in process")}
    out = []
    for c in configs:
        bs = c["label"].split()[0]
        if c is not local[bs]:
            ratio = ratio_spread(c["tokens_per_s_runs"], local[bs]["tokens_per_s_runs"])
            out.append({"label": c["label"], **ratio})
    return out


def format_table(configs: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> str:
    ratios = {c["label"]: c for c in comparisons}
    lines = [
        "| configuration | tok/s median (min - max) | / in process (min - max) | tokens/round "
        "| pre-draft hits | draft wait ms/round |",
        "|---|---|---|---|---|---|",
    ]
    for c in configs:
        lines.append(
            speed_row(c, ratios.get(c["label"]))
            + f" {c['predraft_hit_rate']:.2f} | {c['draft_wait_ms_per_round']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.predraft", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench_results/predraft"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--predraft", type=int, default=4, metavar="N")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench.predraft needs two CPUs: one stands in for each device")
    configs = measure(args.batch, args.predraft, args.repeats)
    comparisons = compare(configs)
    write_json({"configs": configs, "comparisons": comparisons}, args.out / "predraft.json")
    print(format_table(configs, comparisons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
