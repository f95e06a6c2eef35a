"""The shifted workload: the demo pair (trained on the standard library) serves code it never
saw, with ``--online-learning``, and acceptance is measured as tokens are served.

    python -m specmesh.bench.online [--max-tokens 200000] [--out bench_results/online]
        [--domain javascript] [--points 0,10000,...] [--background] [--lr ...]
        [--update-tokens ...]

The in-process engine (fp32, EAGLE-3 5 / 4 / 8) serves new-domain prompts (`online_data`:
``--domain javascript``, the default, or ``python-packages``) in batches of `--batch` requests of `--new-tokens` tokens,
3 in 4 sampled at temperature 0.8 (seeded), 1 in 4 greedy. By default each batch waits for the
learner to finish what it is due (`OnlineLearner.drain`), so the curve depends on tokens served,
not on how busy the machine was; ``--background`` lets it train while serving, as deployed.
At each point, with the learner detached (those requests are neither learned from nor trigger a
swap), it measures the mean accept length (tokens per speculative round, the bonus included)
on the held-out prompts of the new domain and of the standard library, greedy and at 0.8.

Then the draft steps' time with the trainer idle and then busy on the same traffic (a training
step must not delay a draft step), and the ceiling: the same evaluation with the target as its
own draft (a draft that ranks tokens exactly as the target does, with this tree shape). Writes OUT/online.json, OUT/online.md and
OUT/acceptance_vs_tokens.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specmesh.bench.online_data import DOMAINS, load_prompts
from specmesh.bench.online_report import plot, table
from specmesh.bench.report import write_json
from specmesh.defaults import default_models
from specmesh.draft_service.online import OnlineSettings, attach_learner
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams

SPEC = SpecParams(num_steps=5, topk=4, num_draft_tokens=8)
POINTS = (0, 10_000, 25_000, 50_000, 100_000, 150_000, 200_000)


def build(settings: OnlineSettings, checkpoints: Path | None = None, target: str | None = None):
    """The engine and its learner; ``checkpoints``: the learner's --online-learning-dir (each
    version it serves written there, `specmesh draft --model DIR/latest` loads the last);
    ``target``: another target than the demo's (one fine-tuned from it, `demo.finetune`)
    under the shipped draft."""
    from specmesh.router.engine import Engine

    models = default_models()
    fp32 = {"dtype": "fp32"}
    draft = fp32 if checkpoints is None else {**fp32, "online_learning_dir": str(checkpoints)}
    engine = Engine(target or models.target, draft_model=models.draft, draft_kind=models.draft_kind,
                    spec=SPEC, target_config=fp32, draft_config=draft)  # fmt: skip
    return engine, attach_learner(engine.draft, settings)


def ceiling(prompts, eval_tokens: int, target: str | None = None) -> dict[str, float]:
    """The same evaluation with the target as its own (standalone) draft: what a draft that
    knew the target's ranking exactly would reach with this tree shape."""
    from specmesh.router.engine import Engine

    target, fp32 = target or default_models().target, {"dtype": "fp32"}
    engine = Engine(target, draft_model=target, draft_kind="standalone", spec=SPEC,
                    target_config=fp32, draft_config=fp32)  # fmt: skip
    return evaluate(engine, prompts, eval_tokens)


def sampling(i: int, new_tokens: int) -> SamplingParams:
    """Request ``i`` of the traffic: greedy one time in four, else 0.8 with seed ``i``."""
    if i % 4 == 0:
        return SamplingParams(max_new_tokens=new_tokens)
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.8, seed=i)


def accept_length(results) -> float:
    lens = [n for r in results for n in r.accept_lens]
    return sum(lens) / len(lens) if lens else 0.0


def evaluate(engine, prompts, new_tokens: int) -> dict[str, float]:
    """Mean accept length per evaluation set, the learner detached meanwhile."""
    learner, engine.draft.learner = engine.draft.learner, None
    try:
        out = {}
        for name, batch in [("domain", prompts.domain_eval), ("stdlib", prompts.stdlib_eval)]:
            greedy = SamplingParams(max_new_tokens=new_tokens)
            hot = [SamplingParams(max_new_tokens=new_tokens, temperature=0.8, seed=1000 + i)
                   for i in range(len(batch))]  # fmt: skip
            out[f"{name} greedy"] = accept_length(engine.generate(batch, greedy))
            out[f"{name} t0.8"] = accept_length(engine.generate(batch, hot))
        return out
    finally:
        engine.draft.learner = learner


def curve(engine, learner, prompts, args) -> list[dict]:
    """Serve until each point of ``args.points`` and measure there."""
    points, served, requests, serve_s, train_s = [], 0, 0, 0.0, 0.0
    for point in args.points:
        lens: list[int] = []  # the traffic's accept lengths since the last point
        while served < point:
            batch = [next(prompts.traffic) for _ in range(args.batch)]
            params = [sampling(requests + i, args.new_tokens) for i in range(len(batch))]
            started = time.perf_counter()
            results = engine.generate(batch, params)
            serve_s += time.perf_counter() - started
            served += sum(len(r.token_ids) for r in results)
            lens += [n for r in results for n in r.accept_lens]
            requests += len(batch)
            if not args.background:
                started = time.perf_counter()
                learner.drain()
                train_s += time.perf_counter() - started
        started = time.perf_counter()
        accept = evaluate(engine, prompts, args.eval_tokens)
        s = learner.stats()
        points.append({"tokens_served": served, "requests": requests, "serve_s": serve_s,
                       "drain_s": train_s, "eval_s": time.perf_counter() - started,
                       "traffic_accept": sum(lens) / len(lens) if lens else None,
                       "accept_length": accept, "learner": asdict(s)})  # fmt: skip
        print(f"{served:>7} tokens  v{s.version} (kept {s.num_updates}, rolled back "
              f"{s.num_rollbacks})  " + "  ".join(f"{k} {v:.3f}" for k, v in accept.items()),
              flush=True)  # fmt: skip
    return points


def step_times(engine, learner, prompts, args, repeats: int = 3) -> dict[str, dict]:
    """Draft step times on the same greedy batch, the trainer idle or training all the time
    (an update due after every row), ``repeats`` times each, interleaved: per configuration the
    step time percentiles over all its steps and the median tokens/s."""
    runtime, seen = engine.draft, {"trainer idle": [], "trainer busy": []}
    step, saved, rates = runtime.step, learner.settings, {k: [] for k in seen}
    batch = [next(prompts.traffic) for _ in range(args.batch)]
    engine.generate(batch, SamplingParams(max_new_tokens=8))  # warm
    try:
        for _ in range(repeats):
            for label, update_tokens in [("trainer idle", 10**12), ("trainer busy", 1)]:
                learner.settings = replace(saved, update_tokens=update_tokens)
                runtime.step = _timed(step, seen[label])
                started = time.perf_counter()
                results = engine.generate(batch, SamplingParams(max_new_tokens=args.new_tokens))
                tokens = sum(len(r.token_ids) for r in results)
                rates[label].append(tokens / (time.perf_counter() - started))
                learner.settings = replace(saved, update_tokens=10**12)
                learner.drain()  # the busy trainer's last update ends before the next run
    finally:
        runtime.step, learner.settings = step, saved
    out = {}
    for label, times in seen.items():
        ms = sorted(1000 * t for t in times)
        out[label] = {"steps": len(ms), "mean_ms": statistics.fmean(ms),
                      "p50_ms": ms[len(ms) // 2], "p90_ms": ms[int(0.9 * len(ms))],
                      "p99_ms": ms[int(0.99 * len(ms))], "max_ms": ms[-1],
                      "tokens_per_s": statistics.median(rates[label])}  # fmt: skip
        print(f"{label}: {out[label]}", flush=True)
    out["swap_ms_mean"] = 1000 * learner.info.swap_seconds / max(learner.info.num_swaps, 1)
    return out


def _timed(step, into: list[float]):
    def timed(*a, **kw):
        started = time.perf_counter()
        try:
            return step(*a, **kw)
        finally:
            into.append(time.perf_counter() - started)

    return timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.online", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results/online"))
    p.add_argument("--max-tokens", type=int, default=POINTS[-1])
    p.add_argument("--points", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--batch", type=int, default=8, help="requests served together")
    p.add_argument("--new-tokens", type=int, default=128, help="per traffic request")
    p.add_argument("--eval-prompts", type=int, default=12, help="per evaluation set")
    p.add_argument("--eval-tokens", type=int, default=64, help="per evaluation request")
    p.add_argument("--background", action="store_true", help="train while serving")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--domain",
        choices=sorted(DOMAINS),
        default="javascript",
        help="the new domain served (`online_data`)",
    )
    p.add_argument(
        "--online-learning-dir", type=Path, metavar="DIR",
        help="keep the learner's checkpoints there (`bench.online_speed` serves the last one "
        "as the learned draft)",
    )  # fmt: skip
    p.add_argument(
        "--target-model", metavar="DIR",
        help="serve this target under the shipped draft instead of the demo's own (one "
        "fine-tuned on the domain by `specmesh.demo.finetune`; its tokenizer must be the demo's)",
    )  # fmt: skip
    defaults = OnlineSettings()
    for name in ("lr", "update_tokens", "steps_per_update", "batch_windows", "window_tokens"):
        kind = type(getattr(defaults, name))
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name))
    args = p.parse_args(argv)
    args.points = args.points or [t for t in POINTS if t <= args.max_tokens]
    torch.set_num_threads(args.threads)
    settings = replace(defaults, **{k: getattr(args, k) for k in
                       ("lr", "update_tokens", "steps_per_update", "batch_windows", "window_tokens")})  # fmt: skip
    engine, learner = build(settings, args.online_learning_dir, args.target_model)
    pair_dir = Path(default_models().target).parent
    prompts = load_prompts(engine.tokenizer, pair_dir, args.eval_prompts, 64, 0, args.domain)
    started = time.perf_counter()
    points = curve(engine, learner, prompts, args)
    results = {"settings": asdict(settings), "spec": asdict(SPEC), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "points": points, "wall_s": time.perf_counter() - started,
        "step_times": step_times(engine, learner, prompts, args),
        "target_as_draft": ceiling(prompts, args.eval_tokens, args.target_model)}  # fmt: skip
    learner.close()
    write_json(results, args.out / "online.json")
    (args.out / "online.md").write_text(table(results) + "\n")
    plot(results, args.out / "acceptance_vs_tokens.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
