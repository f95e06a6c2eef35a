"""``specmesh bench``: throughput, latency and acceptance of specmesh (in process, drafting with
EAGLE-3 / n-gram / a standalone draft, and as a gRPC cluster) against transformers (plain,
prompt lookup, assisted generation) and, when installed, llama.cpp, on the same checkpoint,
dtype and prompts.

Every (configuration, repeat) runs in a fresh process with the same thread count; the repeats
are interleaved (the whole plan, then again); each configuration reports min / median / max
tokens/s and each comparison the ratio of the medians with the min / max of the per-repeat
ratios. Writes ``OUT/results.json`` (schema: specmesh.bench.schema), PNG plots when matplotlib
is installed, and a table on stdout. ``--quick`` shrinks everything (a CI smoke run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specmesh.cli.cmd_generate import add_model_args

# Full run / --quick defaults for the flags left unset.
FULL = {
    "dtypes": "fp32,bf16", "batch_sizes": "1,8", "compare_batch_sizes": "1,8,32",
    "cluster_batch_sizes": "1,8", "workloads": "code,text", "temperatures": "0,0.7",
    "max_new_tokens": 96, "prompt_len": 96, "min_requests": 8, "repeats": 3,
}  # fmt: skip
QUICK = {
    "dtypes": "fp32", "batch_sizes": "1", "compare_batch_sizes": "1", "cluster_batch_sizes": "1",
    "workloads": "code", "temperatures": "0", "max_new_tokens": 16, "prompt_len": 32,
    "min_requests": 1, "repeats": 1,
}  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark speculative serving", description=__doc__)
    add_model_args(p, auto_runtime=False)  # what runs where is the benchmark's to name
    d = lambda name: f"(default {FULL[name]}; --quick {QUICK[name]})"
    p.add_argument("--dtypes", metavar="fp32,bf16", help=f"weights and activations {d('dtypes')}")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, metavar="N",
        help="split the target of every specmesh side over N ranks (the draft stays on one "
        "device); transformers and llama.cpp run unsharded",
    )  # fmt: skip
    p.add_argument(
        "--pin",
        action="store_true",
        help="one CPU core per device (needs 2): in-process and transformers sides on core 0, "
        "the cluster's target on core 0 and its draft, router and client on core 1, one thread "
        "each: what the split gives with the draft on a device of its own",
    )
    p.add_argument(
        "--predraft",
        type=int,
        default=0,
        metavar="N",
        help="the cluster's draft pre-drafts the N likeliest verify outcomes (specmesh draft "
        "--predraft N)",
    )
    p.add_argument(
        "--predraft-steps",
        type=int,
        metavar="D",
        help="depth of a pre-drafted tree (specmesh draft --predraft-steps D)",
    )
    p.add_argument(
        "--tiny-deepseek",
        action="store_true",
        help="bench a tiny DeepSeek-V3 (MLA + MoE, made once under $SPECMESH_CACHE/bench) with "
        "its own NextN layer as the MTP draft, instead of --target-model / --draft-model / "
        "--draft-kind: MLA + MoE plain and MTP speculative tokens/s and acceptance",
    )
    p.add_argument(
        "--draft-kinds",
        metavar="eagle3,ngram,standalone",
        help="drafting sides: the main draft (--draft-kind) first, then ngram and standalone "
        "(default: all three)",
    )
    p.add_argument(
        "--standalone-draft",
        metavar="DIR",
        help="standalone draft checkpoint for specmesh and transformers' assistant_model "
        "(default: the target's first 2 layers, made once under $SPECMESH_CACHE/bench)",
    )
    p.add_argument(
        "--compare-batch-sizes", metavar="1,8,32",
        help=f"batch sizes of specmesh plain vs transformers {d('compare_batch_sizes')}",
    )  # fmt: skip
    p.add_argument(
        "--cluster-batch-sizes", metavar="1,8",
        help=f"batch sizes of the gRPC cluster vs in process {d('cluster_batch_sizes')}",
    )  # fmt: skip
    p.add_argument(
        "--batch-sizes", metavar="1,8",
        help=f"grid of the main draft over workloads x temperatures {d('batch_sizes')}",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, help=f"tokens per request {d('max_new_tokens')}")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens {d('prompt_len')}")
    p.add_argument(
        "--min-requests", type=int, help=f"requests per configuration at least {d('min_requests')}"
    )
    p.add_argument("--workloads", help=f"code (held-out stdlib), text {d('workloads')}")
    p.add_argument("--temperatures", help=f"0 = greedy {d('temperatures')}")
    p.add_argument(
        "--repeats", type=int, help=f"fresh processes per configuration, interleaved {d('repeats')}"
    )
    p.add_argument(
        "--threads", type=int, help="torch threads of every measured process (default: all cores)"
    )
    p.add_argument(
        "--no-sweep", action="store_true", help="skip the (steps, topk, draft tokens) sweep "
        "(--quick skips it)",
    )  # fmt: skip
    p.add_argument(
        "--no-cluster", "--no-grpc", dest="no_cluster", action="store_true",
        help="skip the gRPC cluster side",
    )  # fmt: skip
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers sides")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp side")
    p.add_argument(
        "--llamacpp-python", default=sys.executable, metavar="PYTHON",
        help="interpreter with llama_cpp installed (default: this one; the side is skipped "
        "when it cannot import llama_cpp)",
    )  # fmt: skip
    p.add_argument(
        "--gguf-dir", metavar="DIR",
        help="target-f32.gguf / target-bf16.gguf for llama.cpp (default: "
        "$SPECMESH_CACHE/bench/<target>-<hash>/gguf)",
    )  # fmt: skip
    p.add_argument(
        "--compare-attention-backends",
        default="",
        metavar="torch,triton,flashinfer",
        help="also run the in-process engine on each attention backend, eagerly and (on CUDA, "
        "triton / flashinfer) with CUDA graphs, plain and speculative; ratios vs torch eager",
    )
    p.add_argument(
        "--engine-batch-sizes",
        default="1,16",
        metavar="1,16",
        help="batch sizes of the attention-backend comparison",
    )
    p.add_argument("--quick", action="store_true", help="few prompts and tokens (CI smoke run)")
    p.add_argument(
        "--http",
        metavar="URL",
        help="only drive this OpenAI-compatible server's /v1/completions (e.g. "
        "http://127.0.0.1:8000) with the same workload and batch sizes; reports tokens/s "
        "(API key: SPECMESH_API_KEY)",
    )
    p.add_argument(
        "--faults", nargs="?", const="all", metavar="SCENARIOS",
        help="run the fault report instead (bench/faults.py): every scenario, or those named; "
        "writes OUT/faults/table.md and results.json",
    )  # fmt: skip
    p.add_argument(
        "--online-learning", nargs="?", const=0, type=int, metavar="TOKENS",
        help="run the online-learning report instead (bench/online.py): the demo pair serves a "
        "domain its draft never saw (JavaScript) with --online-learning, and held-out acceptance "
        "is measured against tokens served (default 200000; --quick 10000); writes OUT/online/ "
        "(online.md, online.json, acceptance_vs_tokens.png)",
    )  # fmt: skip
    p.add_argument(
        "--fine-tuned-target", action="store_true",
        help="with --online-learning: first fine-tune the demo target on the domain "
        "(specmesh.demo.finetune, 224 steps; --quick 4) and serve it under the shipped draft, "
        "learning at 2e-4: the draft's target moved (docs/online-learning.md); writes "
        "OUT/online-finetuned/ (the target, the learned heads, the report)",
    )  # fmt: skip
    p.add_argument(
        "--out", default="bench_results", metavar="DIR", help="output folder (or a .json file path)"
    )
    p.set_defaults(run=run)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers: {e}") from e


def _words(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _picker(args: argparse.Namespace):
    base = QUICK if args.quick else FULL
    return lambda name: base[name] if getattr(args, name) is None else getattr(args, name)


def settings_from_args(args: argparse.Namespace):  # -> BenchSettings
    from specmesh.bench.spawn import available_cores
    from specmesh.bench.suite import SWEEP, BenchSettings, engine_variants
    from specmesh.defaults import local_models, resolve_models
    from specmesh.protocol.config import SpecParams

    if args.tiny_deepseek:
        from specmesh.bench.drafts import tiny_deepseek_dir

        args.target_model = args.draft_model = str(tiny_deepseek_dir())
        args.draft_kind, args.draft_kinds = "mtp", args.draft_kinds or "mtp,ngram"
    models = resolve_models(args.target_model, args.draft_model, args.draft_kind)
    models = local_models(models, args.target_revision, args.draft_revision)
    if models.draft_kind is None:
        raise ValueError(
            "specmesh bench compares speculation: give --draft-kind (and --draft-model)"
        )
    pick = _picker(args)
    dtypes = pick("dtypes") if args.dtypes or not args.dtype else args.dtype
    kinds = _draft_kinds(args, models.draft_kind)
    return BenchSettings(
        models=models,
        spec=SpecParams(args.num_steps, args.topk, args.num_draft_tokens),
        dtypes=_words(dtypes),
        draft_kinds=kinds,
        draft_dirs=_draft_dirs(args, models, kinds),
        compare_batch_sizes=_ints(pick("compare_batch_sizes"), "--compare-batch-sizes"),
        cluster_batch_sizes=_ints(pick("cluster_batch_sizes"), "--cluster-batch-sizes"),
        batch_sizes=_ints(pick("batch_sizes"), "--batch-sizes"),
        workloads=_words(pick("workloads")),
        temperatures=tuple(float(t) for t in _words(pick("temperatures"))),
        max_new_tokens=pick("max_new_tokens"),
        prompt_len=pick("prompt_len"),
        min_requests=pick("min_requests"),
        repeats=pick("repeats"),
        cluster=not args.no_cluster,
        transformers=not args.no_transformers,
        llamacpp=not args.no_llamacpp,
        llamacpp_python=args.llamacpp_python,
        gguf_dir=args.gguf_dir or str(_gguf_default(models.target)),
        sweep=() if args.no_sweep or args.quick else SWEEP,
        runtime={
            "attention_backend": args.attention_backend,
            "device": args.device,
            "tensor_parallel_size": args.tensor_parallel_size,
        },
        threads=1 if args.pin else args.threads or available_cores(),
        pin=_pinned(args.pin),
        cluster_draft_args=_predraft_args(args),
        engines=engine_variants(_names(args.compare_attention_backends), args.device)
        if args.compare_attention_backends
        else (),
        engine_batch_sizes=_ints(args.engine_batch_sizes, "--engine-batch-sizes"),
    )


def _predraft_args(args: argparse.Namespace) -> tuple[str, ...]:
    flags = ("--predraft", str(args.predraft)) if args.predraft else ()
    if args.predraft and args.predraft_steps:
        flags += ("--predraft-steps", str(args.predraft_steps))
    return flags


def _pinned(pin: bool) -> bool:
    import os

    if pin and len(os.sched_getaffinity(0)) < 2:
        raise ValueError("--pin puts target and draft on cores 0 and 1: it needs 2 CPU cores")
    return pin


def _draft_kinds(args: argparse.Namespace, main: str) -> tuple[str, ...]:
    kinds = _words(args.draft_kinds) if args.draft_kinds else (main, "ngram", "standalone")
    kinds = tuple(dict.fromkeys(kinds))  # the main kind may also be ngram or standalone
    extra = [k for k in kinds[1:] if k not in ("ngram", "standalone")]
    if kinds[0] != main or extra:
        raise ValueError(
            f"--draft-kinds: the main draft {main!r} first, then ngram / standalone; got {kinds}"
        )
    return kinds


def _draft_dirs(args: argparse.Namespace, models, kinds: tuple[str, ...]) -> dict:
    """Checkpoint per drafting kind; the default standalone draft is made here, once."""
    from specmesh.bench.drafts import default_draft_dir, layer_skip_draft

    dirs = {models.draft_kind: models.draft}
    if "standalone" in kinds and dirs.get("standalone") is None:
        made = args.standalone_draft or str(
            layer_skip_draft(models.target, default_draft_dir(models.target))
        )
        dirs["standalone"] = made
    return dirs


def _gguf_default(target: str) -> Path:
    from specmesh.bench.drafts import target_cache_dir

    return target_cache_dir(target) / "gguf"


def _names(text: str) -> tuple[str, ...]:
    from specmesh.cli.serve_args import BACKENDS

    names = _words(text)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown attention backend(s) {unknown}; choose from {BACKENDS}")
    return names


def run(args: argparse.Namespace) -> int:
    from specmesh.bench import report, schema
    from specmesh.bench.session import run_bench

    if args.http:
        return run_http_mode(args)
    if args.faults:
        from specmesh.bench.faults import main as run_faults

        picked = [] if args.faults == "all" else ["--scenarios", args.faults]
        models = ["--target-model", args.target_model] if args.target_model else []
        models += ["--draft-model", args.draft_model] if args.draft_model else []
        return run_faults(["--out", str(Path(args.out) / "faults"), *picked, *models])
    if args.online_learning is not None:
        return run_online(args)
    if args.fine_tuned_target:
        raise ValueError("--fine-tuned-target needs --online-learning")
    results = run_bench(settings_from_args(args))
    out = Path(args.out)
    json_path = out if out.suffix == ".json" else out / "results.json"
    report.write_json(results, json_path)
    plots = report.write_plots(results, json_path.parent)
    print(report.format_table(results))
    print(f"\nwrote {json_path}" + "".join(f", {p}" for p in plots))
    missing = schema.check(results)
    if missing:
        raise ValueError(f"results are missing fields: {', '.join(missing[:10])}")
    return 0


def run_online(args: argparse.Namespace) -> int:
    """``--online-learning [TOKENS]``: `bench.online` on the demo pair (its own flags there);
    with ``--fine-tuned-target``, on the demo target fine-tuned first (`demo.finetune`)."""
    from specmesh.bench.online import main as run_online_report

    tokens = args.online_learning or (10_000 if args.quick else 200_000)
    quick = ["--eval-prompts", "2", "--eval-tokens", "16", "--new-tokens", "32"]
    folder = Path(args.out) / ("online-finetuned" if args.fine_tuned_target else "online")
    out = ["--out", str(folder), "--max-tokens", str(tokens)]
    if args.fine_tuned_target:
        from specmesh.demo.finetune import main as finetune

        target = str(folder / "target")
        steps = "4" if args.quick else "224"
        if finetune([target, "--steps", steps, "--seconds", "1e9"]) != 0:
            return 1
        learned = ["--online-learning-dir", str(folder / "learned")]  # for bench.online_speed
        out += ["--target-model", target, "--lr", "2e-4", *learned]
    return run_online_report(out + (quick if args.quick else []))


def run_http_mode(args: argparse.Namespace) -> int:
    """``--http URL``: the first workload's prompts (this --target-model's tokenizer) at each
    batch size and temperature, through the server's /v1/completions."""
    import os

    from specmesh.bench.http_client import format_results, run_http
    from specmesh.bench.workloads import load_workload
    from specmesh.defaults import local_models, resolve_models
    from specmesh.router.tokenizer import load_tokenizer

    pick = _picker(args)
    batches = _ints(pick("batch_sizes"), "--batch-sizes")
    target = resolve_models(args.target_model, None, None)
    tokenizer = load_tokenizer(local_models(target, args.target_revision).target)
    name = _words(pick("workloads"))[0]
    num = max(max(batches), pick("min_requests"))
    workload = load_workload(name, tokenizer, num, pick("prompt_len"))
    key = os.environ.get("SPECMESH_API_KEY")
    for temperature in (float(t) for t in _words(pick("temperatures"))):
        results = [
            run_http(args.http, workload.prompts[: max(b, pick("min_requests"))],
                     pick("max_new_tokens"), b, temperature, key)
            for b in batches
        ]  # fmt: skip
        print(f"workload {name}, temperature {temperature}")
        print(format_results(args.http.rstrip("/"), results))
    return 0
