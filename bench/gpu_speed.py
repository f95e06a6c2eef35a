"""Tokens/s of one engine configuration on a GPU, plain against speculative, at several batch
sizes, in one process with clean state between runs:

    python -m specmesh.bench.gpu_speed --target-model DIR --draft-model DIR --draft-kind eagle3 \
        --attention-backend triton [--disable-cuda-graph] [--transformers] --out FILE.json

The model is loaded and its CUDA graphs captured once; every run then starts from an empty
engine (no request, no KV held) and generates ``--max-new-tokens`` (EOS ignored) for each of
``batch`` code prompts of ``--prompt-len`` tokens, all in flight at once. Repeats are
interleaved (every (batch, mode) once, then again) and each figure is min / median / max over
them; the speculative/plain ratio is that of the medians, with the min / max of the per-repeat
ratios. ``--transformers`` measures ``model.generate`` (greedy, same prompts, a batch is one
left-padded call) instead, in its own process: the baseline for the same table. ``--cluster``
measures the same runs through target, draft and router processes on loopback gRPC (started
once, as `specmesh up` does), requests through the router's public API.

Loading a GPU process costs far more than a run here (an 8B-shaped checkpoint is 16 GB), which
is why this reuses one process per configuration rather than one per run (`specmesh bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import time
from typing import Any

import torch

from specmesh.bench.metrics import ratio_spread, spread
from specmesh.bench.report import emit_json
from specmesh.bench.workloads import load_workload
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.router_config import RouterConfig
from specmesh.router.tokenizer import load_tokenizer


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def engine_runner(args: argparse.Namespace, spec: SpecParams):
    """``run(prompts, speculate)`` -> (seconds, generated tokens, mean accept length)."""
    from specmesh.router.engine import Engine

    runtime = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend,
               "cuda_graph": not args.disable_cuda_graph, "cuda_graph_max_bs": max(args.sizes)}  # fmt: skip
    engine = Engine(
        args.target_model, draft_model=args.draft_model, draft_kind=args.draft_kind, spec=spec,
        target_config=runtime, draft_config=runtime,
        router_config=RouterConfig(
            max_batch_size=max(args.sizes), num_micro_batches=args.num_micro_batches
        ),
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def run(prompts: list[list[int]], speculate: bool) -> tuple[float, int, float]:
        sync(args.device)
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, disable_speculation=not speculate)
        sync(args.device)
        accepts = [a for r in results for a in r.accept_lens]
        mean = sum(accepts) / len(accepts) if accepts else 1.0
        return time.perf_counter() - t0, sum(len(r.token_ids) for r in results), mean

    return run


def cluster_runner(args: argparse.Namespace, spec: SpecParams, stack: contextlib.ExitStack):
    """The same runs through a local gRPC cluster (target, draft and router processes sharing
    the device, as `specmesh up` starts them); requests go through the router's public API.
    The services capture their CUDA graphs as they start (no --disable-cuda-graph here)."""
    import asyncio

    from specmesh.bench.runners import RunSpec
    from specmesh.bench.stacks import local_deployment
    from specmesh.cluster import spawn_service
    from specmesh.defaults import ModelChoice

    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    models = ModelChoice(args.target_model, args.draft_model, args.draft_kind)
    runtime = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend}  # fmt: skip
    router_args = ["--max-batch-size", str(max(args.sizes))]
    if args.num_micro_batches is not None:
        router_args += ["--num-micro-batches", str(args.num_micro_batches)]
    extra = {"draft": shlex.split(args.draft_args), "target": shlex.split(args.target_args),
             "router": shlex.split(args.router_args)}  # fmt: skip

    def spawn(children: list, kind: str, flags: list[str]) -> str:
        return spawn_service(children, kind, [*flags, *extra.get(kind, [])])

    deployment = local_deployment(models, spec, runtime, "always", router_args, spawn=spawn)
    cluster = loop.run_until_complete(deployment.__aenter__())
    stack.callback(lambda: loop.run_until_complete(deployment.__aexit__(None, None, None)))

    def run(prompts: list[list[int]], speculate: bool) -> tuple[float, int, float]:
        n = len(prompts)
        rs = RunSpec("cluster", "code", n, 0.0, spec if speculate else None, args.max_new_tokens,
                     n, args.dtype, args.draft_kind if speculate else None)  # fmt: skip
        out = loop.run_until_complete(cluster.run(rs, prompts))
        return out["wall_s"], out["generated_tokens"], out["mean_accept_len"]

    return run


def transformers_runner(args: argparse.Namespace, pad_token_id: int):
    from specmesh.bench.hf import TransformersBackend
    from specmesh.runtime.config import parse_dtype

    dtype = parse_dtype(args.dtype)
    hf = TransformersBackend(args.target_model, dtype, pad_token_id, None, args.device)

    def run(prompts: list[list[int]], speculate: bool) -> tuple[float, int, float]:
        sync(args.device)
        t0 = time.perf_counter()
        hf.generate(prompts, args.max_new_tokens)  # raises unless every prompt got them all
        sync(args.device)
        return time.perf_counter() - t0, args.max_new_tokens * len(prompts), 1.0

    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        return _measure(args, stack)


def _measure(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    spec = SpecParams(*args.spec)
    tokenizer = load_tokenizer(args.target_model)
    prompts = load_workload("code", tokenizer, max(args.sizes), args.prompt_len).prompts
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    modes = ("plain", "speculative")
    if args.transformers:
        run, modes = transformers_runner(args, pad), ("plain",)
    elif args.cluster:
        run = cluster_runner(args, spec, stack)
    else:
        run = engine_runner(args, spec)
    run(prompts[:1], modes[-1] == "speculative")  # warm-up: compile, allocate
    runs: dict[tuple[int, str], list[tuple[float, int, float]]] = {}
    for _ in range(args.repeats):
        for b in args.sizes:
            for mode in modes:
                runs.setdefault((b, mode), []).append(run(prompts[:b], mode == "speculative"))
    rows = []
    for (b, mode), rs in runs.items():
        tps = [n / s for s, n, _ in rs]
        rows.append({"batch_size": b, "mode": mode, "tokens_per_s": spread(tps),
                     "tokens_per_s_runs": tps, "accept_len": statistics.median(a for *_, a in rs)})  # fmt: skip
    ratios = {}
    if not args.transformers:
        for b in args.sizes:
            spec_tps = [n / s for s, n, _ in runs[(b, "speculative")]]
            plain_tps = [n / s for s, n, _ in runs[(b, "plain")]]
            ratios[f"speculative_vs_plain_b{b}"] = ratio_spread(spec_tps, plain_tps)
    return {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "side": "transformers" if args.transformers else "cluster" if args.cluster else "specmesh",
        "target": args.target_model, "draft": args.draft_model, "dtype": args.dtype,
        "attention_backend": None if args.transformers else args.attention_backend,
        "cuda_graph": not (args.transformers or args.disable_cuda_graph),
        "processes": "target, draft, router" if args.cluster else "one",
        "service_args": {"draft": args.draft_args, "target": args.target_args} if args.cluster
        else None,
        "num_micro_batches": None if args.transformers
        else RouterConfig(num_micro_batches=args.num_micro_batches).micro_batches(args.cluster),
        "spec": list(args.spec), "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len, "repeats": args.repeats, "rows": rows, "ratios": ratios,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.gpu_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target-model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--draft-kind", default="eagle3")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--disable-cuda-graph", action="store_true")
    side = p.add_mutually_exclusive_group()
    side.add_argument("--transformers", action="store_true", help="measure transformers instead")
    side.add_argument(
        "--cluster", action="store_true",
        help="measure a local gRPC cluster (target, draft, router processes) instead",
    )  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--spec", default="5,4,8", help="num_steps,topk,num_draft_tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-micro-batches", type=int, default=RouterConfig.num_micro_batches,
                   help="the router's micro-batches (default: 2 over gRPC, 1 in process; over "
                   "gRPC the requests of a run are split between them as they arrive)")  # fmt: skip
    p.add_argument("--draft-args", default="", help="--cluster: extra flags of the draft "
                   "service, as one string: --draft-args='--predraft 4'")  # fmt: skip
    p.add_argument("--target-args", default="", help="--cluster: extra flags of the target "
                   "service: --target-args=--no-run-ahead")  # fmt: skip
    p.add_argument("--router-args", default="", help="--cluster: extra flags of the router: "
                   "--router-args=--shared-memory")  # fmt: skip
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    args.sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.spec = tuple(int(x) for x in args.spec.split(","))
    emit_json(measure(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
