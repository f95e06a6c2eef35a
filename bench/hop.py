"""What the gRPC hop costs, as pure system cost: a near-free model (Llama, 4 layers, 64 wide,
and a random EAGLE-3 head) served in process and as a cluster, batch 1.

    python -m specmesh.bench.hop [--out DIR] [--repeats 3] [--only plain|eagle3] [--profile]
        [--inline-step-ms MS] [--pin]

Six configurations, each (configuration, repeat) in a fresh `bench.worker` process, repeats
interleaved (A1 B1 C1 D1 E1 F1 A2 ...): in process plain, cluster plain, cluster plain with the
target's run-ahead off (`--no-run-ahead`), cluster plain with the router's pipelined decoding
off (`--no-pipeline-decode`), in process EAGLE-3, cluster EAGLE-3 (`--speculation always`: every
round drafts and verifies the full tree; acceptance does not matter). The cluster is
`bench.stacks.local_deployment`: target, draft and router processes on loopback; its plain run
keeps the draft service up, idle (the requests disable speculation). Requests run one at a
time, greedy, ``PROMPT_LEN`` prompt tokens, ``MAX_NEW_TOKENS`` new ones. ``--only`` runs the
plain or the EAGLE-3 configurations alone.

Beside each ratio: the gRPC floor of its round (`bench.hop_floor`: a bare `grpc.aio` echo on
this machine, one round trip per service the round calls), the best ratio a round that calls
its services one after the other could reach over that floor, and what two processes taking
turns reach here with no wire at all (`bench.alternation`, sized to the mode's in-process
round, placed as the sides are): on a machine whose idle cores go cold that alone is below 1.

A round is one streamed chunk after the first (prefill's) token: a decode step, or one draft +
verify. ms/round = (last chunk - first chunk) / rounds, over a run's requests.

``--pin`` gives each device a core, as `specmesh bench --pin` does: in process on core 0, the
cluster's target on core 0 and its draft, router and the measuring client on core 1.

``--profile`` then runs the cluster once more per mode with each service under `cProfile`
(`bench.hop_profile`: every Python thread, merged), profiling exactly one run of requests (after
a warm-up one), and prints each process's top functions by cumulative time, with their time
per round. Writes ``OUT/hop.json`` and ``OUT/profile/<mode>-<service>.prof``; the models go to
``OUT/models`` (built once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specmesh.bench import alternation, hop_floor
from specmesh.bench.hop_profile import ProfiledSpawn, top_functions
from specmesh.bench.metrics import aggregate, ratio_spread, spread
from specmesh.bench.report import write_json
from specmesh.bench.runners import RunSpec
from specmesh.bench.session import cpu_model
from specmesh.bench.spawn import run_worker
from specmesh.bench.worker import ONE_DEVICE, TWO_DEVICES, Job
from specmesh.defaults import ModelChoice
from specmesh.protocol.config import SpecParams

SPEC = SpecParams(num_steps=3, topk=2, num_draft_tokens=4)
DRAFT_KIND, DTYPE, WORKLOAD = "eagle3", "fp32", "code"
PROMPT_LEN, MAX_NEW_TOKENS, NUM_REQUESTS = 32, 64, 8
TARGET_DIMS = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128}
# SpecForge "output" numbering; the default [1, L/2 - 1, L - 4] is [1, 1, 0] at 4 layers
AUX_LAYER_IDS = (0, 1, 2)
WORKER = [sys.executable, "-m", "specmesh.bench.worker"]
WORKER_TIMEOUT_S = 900.0
# The target's flag that turns run-ahead decoding off: the plain cluster runs with it too, so
# the hop itself shows beside what run-ahead hides of it.
NO_RUN_AHEAD = "--no-run-ahead"
# The router's flag that turns pipelined plain decoding off (`router.round`): the step after a
# plain round is sent only once the last is emitted.
NO_PIPELINE = "--no-pipeline-decode"
# (mode, cluster configuration, in-process configuration) of each ratio reported
MODES = (
    ("plain", "cluster plain", "inprocess plain"),
    (f"plain {NO_RUN_AHEAD}", f"cluster plain {NO_RUN_AHEAD}", "inprocess plain"),
    (f"plain {NO_PIPELINE}", f"cluster plain {NO_PIPELINE}", "inprocess plain"),
    (DRAFT_KIND, f"cluster {DRAFT_KIND}", f"inprocess {DRAFT_KIND}"),
)


def build_models(root: Path) -> ModelChoice:
    """The near-free target and its EAGLE-3 head under ``root`` (written once)."""
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    target, draft = root / "target", root / DRAFT_KIND
    if not (target / "config.json").exists():
        make_tiny_target(target, **TARGET_DIMS)
    if not (draft / "config.json").exists():
        make_tiny_eagle3(draft, target, aux_layer_ids=AUX_LAYER_IDS)
    return ModelChoice(str(target), str(draft), DRAFT_KIND)


@dataclass(frozen=True)
class Config:
    """One measured configuration: a run, and flags its cluster's target and router get
    besides."""

    run: RunSpec
    target_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    inline_step_ms: float | None = None  # both services' --inline-step-ms (None: their default)

    @property
    def kind(self) -> str:
        return DRAFT_KIND if self.run.spec else "plain"

    @property
    def label(self) -> str:
        inline = (
            [] if self.inline_step_ms is None else [f"--inline-step-ms {self.inline_step_ms:g}"]
        )
        return " ".join(
            [self.run.backend, self.kind, *self.target_args, *self.router_args, *inline]
        )


def plan(
    num_requests: int, only: str | None = None, inline_step_ms: float | None = None
) -> list[Config]:
    """In process and cluster back to back, plain (the cluster with run-ahead on and off)
    then EAGLE-3; ``only``: the configurations of one of the two; ``inline_step_ms``: one more
    EAGLE-3 cluster, both services given ``--inline-step-ms``."""

    def run(backend: str, spec: SpecParams | None) -> RunSpec:
        kind = DRAFT_KIND if spec else None
        return RunSpec(backend, WORKLOAD, 1, 0.0, spec, MAX_NEW_TOKENS, num_requests, DTYPE, kind)

    configs = [
        Config(run("inprocess", None)),
        Config(run("cluster", None)),
        Config(run("cluster", None), (NO_RUN_AHEAD,)),
        Config(run("cluster", None), router_args=(NO_PIPELINE,)),
        Config(run("inprocess", SPEC)),
        Config(run("cluster", SPEC)),
    ]
    if inline_step_ms is not None:
        configs.append(Config(run("cluster", SPEC), inline_step_ms=inline_step_ms))
    return [c for c in configs if only is None or c.kind == only]


def num_rounds(res: dict[str, Any]) -> int:
    """Rounds of a run: its verify rounds, or (plain) its tokens after each request's first."""
    return res["num_rounds"] if res["speculative"] else res["generated_tokens"] - res["num_requests"]  # fmt: skip


def ms_per_round(res: dict[str, Any]) -> float:
    """Decode time (first chunk to last, summed over requests) per round."""
    decode_s = res["tpot_s_mean"] * (res["generated_tokens"] - res["num_requests"])
    return 1e3 * decode_s / num_rounds(res)


def measure(
    models: ModelChoice,
    threads: int,
    repeats: int,
    num_requests: int,
    only: str | None = None,
    inline_step_ms: float | None = None,
    pin: bool = False,
) -> list[dict]:
    """Every (configuration, repeat) in its own worker process; one aggregated entry each.
    ``only``: the plain configurations, or the EAGLE-3 ones."""
    from specmesh.bench.workloads import load_workload
    from specmesh.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(models.target)
    prompts = load_workload(WORKLOAD, tokenizer, num_requests, PROMPT_LEN).prompts
    pad = tokenizer.pad_token_id or 0
    by_label: dict[str, list[dict[str, Any]]] = {}
    configs = plan(num_requests, only, inline_step_ms)
    order = [(r, c) for r in range(repeats) for c in configs]  # interleaved
    # in-process label -> per repeat: (layers, (one process ms, two processes ms))
    turns: dict[str, list[tuple[int, tuple[float, float]]]] = {}
    for i, (repeat, c) in enumerate(order):
        runtime = {} if c.inline_step_ms is None else {"inline_step_ms": c.inline_step_ms}
        cpus = {} if not pin else TWO_DEVICES if c.run.backend == "cluster" else ONE_DEVICE
        job = Job(c.run, models.target, models.draft, runtime, threads, prompts, pad,
                  (DRAFT_KIND, SPEC), target_args=list(c.target_args),
                  router_args=list(c.router_args), cpus=cpus)  # fmt: skip
        res = run_worker(WORKER, job.to_json(), threads, WORKER_TIMEOUT_S)
        res |= {"repeat": repeat, "ms_per_round": ms_per_round(res), "label": c.label}
        by_label.setdefault(c.label, []).append(res)
        print(f"[hop {i + 1}/{len(order)}] {c.label}: {res['tokens_per_s']:.1f} tok/s, "
              f"{res['ms_per_round']:.2f} ms/round", file=sys.stderr, flush=True)  # fmt: skip
        if c.run.backend == "inprocess":  # two processes taking turns, sized to this round
            runs = turns.setdefault(c.label, [])  # sized once, to its first round
            layers = runs[0][0] if runs else alternation.sized(res["ms_per_round"], pin)
            runs.append((layers, alternation.once(layers, pin=pin)))
    out = [_config(runs) for runs in by_label.values()]
    for c in out:
        if c["label"] in turns:
            sizes, runs = zip(*turns[c["label"]], strict=True)
            c["turns"] = alternation.summary(list(runs), list(sizes), alternation.ROUNDS, pin)
    return out


def _config(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [r["ms_per_round"] for r in runs]
    return aggregate(runs) | {"label": runs[0]["label"], "ms_per_round": spread(ms), "ms_per_round_runs": ms}  # fmt: skip


def compare(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode measured: cluster / in process tokens/s, and the milliseconds per round the
    hop adds."""
    by_label = {c["label"]: c for c in configs}
    out = []
    for mode, cluster_label, local_label in MODES:
        if cluster_label not in by_label:
            continue
        cluster, local = by_label[cluster_label], by_label[local_label]
        extra = [a - b for a, b in zip(cluster["ms_per_round_runs"], local["ms_per_round_runs"], strict=True)]  # fmt: skip
        median_extra = cluster["ms_per_round"]["median"] - local["ms_per_round"]["median"]
        ratio = ratio_spread(cluster["tokens_per_s_runs"], local["tokens_per_s_runs"])
        out.append({"mode": mode, **ratio, "extra_ms_per_round": median_extra,
                    "extra_ms_per_round_min": min(extra), "extra_ms_per_round_max": max(extra)})  # fmt: skip
    return out


def format_tables(configs: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> str:
    """Markdown: per configuration, then per mode (the hop)."""
    head = "| configuration | tok/s median (min - max) | ms/round median (min - max) | tokens/round | TTFT ms |"  # fmt: skip
    lines = [head, "|---|---|---|---|---|"]
    for c in configs:
        ms = c["ms_per_round"]
        lines.append(
            f"| {c['label']} | {c['tokens_per_s']:.1f} ({c['tokens_per_s_min']:.1f} - "
            f"{c['tokens_per_s_max']:.1f}) | {ms['median']:.2f} ({ms['min']:.2f} - {ms['max']:.2f})"
            f" | {c['mean_accept_len']:.2f} | {1e3 * c['ttft_s_mean']:.1f} |"
        )
    lines += ["", "| mode | cluster / in process, tok/s (min - max) | hop ms/round (min - max) "
              "| gRPC floor ms/round | best sequential ratio | two processes taking turns, no "
              "wire (min - max) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in comparisons:
        turns = c.get("turns")
        lines.append(
            f"| {c['mode']} | {c['ratio']:.2f} ({c['ratio_min']:.2f} - {c['ratio_max']:.2f}) | "
            f"{c['extra_ms_per_round']:+.2f} ({c['extra_ms_per_round_min']:.2f} - "
            f"{c['extra_ms_per_round_max']:.2f}) | {c['floor_ms_per_round']:.2f} | "
            f"{c['best_sequential_ratio']:.2f} | "
            + (f"{turns['ratio']:.2f} ({turns['ratio_min']:.2f} - {turns['ratio_max']:.2f}) |"
               if turns else "- |")
        )  # fmt: skip
    return "\n".join(lines)


def with_floor(
    comparisons: list[dict[str, Any]], configs: list[dict[str, Any]], floor: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each mode with the gRPC floor of its round (`bench.hop_floor`: a plain round is one
    small round trip, an EAGLE-3 round a small one and one carrying feature rows) and the best
    ratio a round calling its services in sequence could reach: in process / (in process +
    floor), per round."""
    small, rows = (f["round_trip_ms"] for f in floor)
    by_label = {c["label"]: c for c in configs}
    local = {label: c["ms_per_round"]["median"] for label, c in by_label.items()}
    for c in comparisons:
        mode = next(m for m in MODES if m[0] == c["mode"])
        floor_ms = small + (rows if mode[0] == DRAFT_KIND else 0.0)
        c["floor_ms_per_round"] = floor_ms
        c["best_sequential_ratio"] = local[mode[2]] / (local[mode[2]] + floor_ms)
        c["turns"] = by_label[mode[2]].get("turns")  # `measure`: beside each in-process run
    return comparisons


# -- --profile ----------------------------------------------------------------------------------


async def _profiled_run(models: ModelChoice, run: RunSpec, spawn: ProfiledSpawn) -> dict:
    """One warm-up request, then ``run`` inside the profiles' window."""
    from specmesh.bench.stacks import local_deployment
    from specmesh.bench.workloads import load_workload
    from specmesh.router.tokenizer import load_tokenizer

    prompts = load_workload(WORKLOAD, load_tokenizer(models.target), run.num_requests, PROMPT_LEN)
    async with local_deployment(models, SPEC, {"dtype": DTYPE}, spawn=spawn) as cluster:
        await cluster.run(replace(run, num_requests=1), prompts.prompts)
        await spawn.send_signal(signal.SIGUSR1)
        res = await cluster.run(run, prompts.prompts)
        await spawn.send_signal(signal.SIGUSR2)
        return res


def profile(
    models: ModelChoice, out: Path, num_requests: int, only: str | None = None
) -> dict[str, Any]:
    """Each cluster mode once with its services profiled; prints and returns their tops."""
    report: dict[str, Any] = {}
    runs = [c.run for c in plan(num_requests, only)
            if c.run.backend == "cluster" and not c.target_args + c.router_args]  # fmt: skip
    for run in runs:  # the cluster's, run-ahead and pipelining on
        spawn = ProfiledSpawn(out / "profile", run.mode)
        spawn.prof_dir.mkdir(parents=True, exist_ok=True)
        res = asyncio.run(_profiled_run(models, run, spawn))
        rounds = num_rounds(res)
        entry = report[run.mode] = {"rounds": rounds, "tokens_per_s": res["tokens_per_s"]}
        for kind, path in spawn.profiles().items():
            entry[kind] = {"profile": str(path), "top": top_functions(path, rounds)}
            print(f"\n== cluster {run.mode}, {kind}: {rounds} rounds, {res['tokens_per_s']:.1f} "
                  f"tok/s under the profiler ({path})", *entry[kind]["top"], sep="\n")  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.hop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", help="models, hop.json, profiles (default: a new temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS, help="per run")
    parser.add_argument("--profile", action="store_true", help="profile the cluster services")
    parser.add_argument("--only", choices=("plain", DRAFT_KIND),
                        help="run only the plain or only the EAGLE-3 configurations")  # fmt: skip
    parser.add_argument("--inline-step-ms", type=float, metavar="MS",
                        help="one more EAGLE-3 cluster, its services given --inline-step-ms MS")  # fmt: skip
    parser.add_argument("--pin", action="store_true",
                        help="a core per device: in process on core 0; the cluster's target on "
                        "core 0, its draft, router and the client on core 1")  # fmt: skip
    args = parser.parse_args(argv)
    if min(args.repeats, args.num_requests) < 1:
        parser.error("--repeats and --num-requests must be >= 1")
    run_hop(Path(args.out or tempfile.mkdtemp(prefix="specmesh-hop-")), args)
    return 0


def run_hop(out: Path, args: argparse.Namespace) -> None:
    from specmesh.cluster import model_threads

    started = time.time()
    models = build_models(out / "models")
    threads = model_threads(2)  # what each cluster model service gets: the same in process
    configs = measure(
        models, threads, args.repeats, args.num_requests, args.only, args.inline_step_ms, args.pin
    )
    floor = hop_floor.measure()
    comparisons = with_floor(compare(configs), configs, floor)
    print(format_tables(configs, comparisons), hop_floor.format_floor(floor), sep="\n\n")
    results = {
        "meta": {
            "cpu_model": cpu_model(), "num_cpus": os.cpu_count(), "repeats": args.repeats,
            "threads": {"inprocess": threads, "target": threads, "draft": threads, "router": 1},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": time.time() - started, "target": TARGET_DIMS, "spec": asdict(SPEC),
            "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW_TOKENS,
            "num_requests": args.num_requests, "aux_layer_ids": AUX_LAYER_IDS, "pin": args.pin,
        },
        "configs": configs,
        "comparisons": comparisons,
        "floor": floor,
    }  # fmt: skip
    if args.profile:
        results["profile"] = profile(models, out, args.num_requests, args.only)
    write_json(results, out / "hop.json")
    print(f"\nwrote {out / 'hop.json'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
