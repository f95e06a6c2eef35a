"""``specmesh bench``: throughput, latency, acceptance and where the time goes, for the in-process
engine, a local gRPC deployment and the ``transformers`` baseline, measured side by side.

Writes ``OUT/results.json`` (schema: specmesh.bench.schema), PNG plots when matplotlib is
installed, and a table on stdout. ``--quick`` shrinks everything (a CI smoke run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specmesh.cmd_generate import add_model_args

# Full run / --quick defaults for the flags left unset.
FULL = {"batch_sizes": "1,2,4,8,16,32", "max_new_tokens": 96, "prompt_len": 96, "min_requests": 8}
QUICK = {"batch_sizes": "1,8", "max_new_tokens": 16, "prompt_len": 32, "min_requests": 2}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark speculative serving", description=__doc__)
    add_model_args(p)
    p.add_argument(
        "--batch-sizes",
        metavar="1,8",
        help=f"requests in flight (default {FULL['batch_sizes']}; --quick {QUICK['batch_sizes']})",
    )
    p.add_argument(
        "--compare-batch-sizes",
        default="1,8",
        metavar="1,8",
        help="batch sizes of the side-by-side comparisons",
    )
    p.add_argument(
        "--max-new-tokens", type=int, help=f"tokens per request (default {FULL['max_new_tokens']})"
    )
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    p.add_argument(
        "--min-requests",
        type=int,
        help=f"requests per configuration at least (default {FULL['min_requests']})",
    )
    p.add_argument(
        "--workloads", default="code,text", help="code (held-out stdlib), text (docstrings)"
    )
    p.add_argument("--temperatures", default="0,0.7", help="0 = greedy")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the plan N times, keep each configuration's fastest run",
    )
    p.add_argument(
        "--no-sweep", action="store_true", help="skip the (steps, topk, draft tokens) sweep"
    )
    p.add_argument("--no-grpc", action="store_true", help="skip the local gRPC deployment")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
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
        "--out", default="bench_results", metavar="DIR", help="output folder (or a .json file path)"
    )
    p.set_defaults(run=run)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers: {e}") from e


def settings_from_args(args: argparse.Namespace):  # -> BenchSettings
    from specmesh.bench.suite import SWEEP, BenchSettings, engine_variants
    from specmesh.defaults import resolve_models
    from specmesh.draft_service.drafter import SpecParams

    models = resolve_models(args.target_model, args.draft_model, args.draft_kind)
    if models.draft_kind is None:
        raise ValueError(
            "specmesh bench compares speculation: give --draft-kind (and --draft-model)"
        )
    base = QUICK if args.quick else FULL
    pick = lambda name: base[name] if getattr(args, name) is None else getattr(args, name)
    runtime = {
        "attention_backend": args.attention_backend,
        "dtype": args.dtype,
        "device": args.device,
    }
    service_args = [f"--{k.replace('_', '-')}={v}" for k, v in runtime.items() if v is not None]
    return BenchSettings(
        models=models,
        spec=SpecParams(args.num_steps, args.topk, args.num_draft_tokens),
        batch_sizes=_ints(pick("batch_sizes"), "--batch-sizes"),
        compare_batch_sizes=_ints(args.compare_batch_sizes, "--compare-batch-sizes"),
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        temperatures=tuple(float(t) for t in args.temperatures.split(",") if t.strip()),
        max_new_tokens=pick("max_new_tokens"),
        prompt_len=pick("prompt_len"),
        min_requests=pick("min_requests"),
        repeats=args.repeats,
        grpc=not args.no_grpc,
        transformers=not args.no_transformers,
        sweep=() if args.no_sweep else SWEEP,
        runtime=runtime,
        service_args=tuple(service_args),
        engines=engine_variants(_names(args.compare_attention_backends), args.device)
        if args.compare_attention_backends
        else (),
        engine_batch_sizes=_ints(args.engine_batch_sizes, "--engine-batch-sizes"),
    )


def _names(text: str) -> tuple[str, ...]:
    from specmesh.cmd_serve import BACKENDS

    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown attention backend(s) {unknown}; choose from {BACKENDS}")
    return names


def run(args: argparse.Namespace) -> int:
    from specmesh.bench import report, schema
    from specmesh.bench.session import run_bench

    if args.http:
        return run_http_mode(args)
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


def run_http_mode(args: argparse.Namespace) -> int:
    """``--http URL``: the first workload's prompts (this --target-model's tokenizer) at each
    batch size and temperature, through the server's /v1/completions."""
    import os

    from specmesh.bench.http_client import format_results, run_http
    from specmesh.bench.workloads import load_workload
    from specmesh.defaults import resolve_models
    from specmesh.runtime.tokenizer import load_tokenizer

    base = QUICK if args.quick else FULL
    pick = lambda name: base[name] if getattr(args, name) is None else getattr(args, name)
    batches = _ints(pick("batch_sizes"), "--batch-sizes")
    tokenizer = load_tokenizer(resolve_models(args.target_model, None, None).target)
    name = args.workloads.split(",")[0].strip()
    num = max(max(batches), pick("min_requests"))
    workload = load_workload(name, tokenizer, num, pick("prompt_len"))
    key = os.environ.get("SPECMESH_API_KEY")
    for temperature in (float(t) for t in args.temperatures.split(",") if t.strip()):
        results = [
            run_http(args.http, workload.prompts[: max(b, pick("min_requests"))],
                     pick("max_new_tokens"), b, temperature, key)
            for b in batches
        ]  # fmt: skip
        print(f"workload {name}, temperature {temperature}")
        print(format_results(args.http.rstrip("/"), results))
    return 0
