"""Prefix caching through the cluster: time to the first token and to the 16th of a request
whose 400-token prefix an earlier request computed, against the same request with the services'
prefix cache off (the demo pair, EAGLE-3, fp32, greedy).

    python -m specmesh.bench.prefix [--out DIR] [--repeats 3] [--requests 6] [--device cuda]

Each side is its own deployment (`bench.stacks.local_deployment`: target, draft and router
processes), sides alternate per repeat. A deployment first serves one request that fills the
cache with the shared prefix, then ``--requests`` requests of the same length, one at a time,
each the shared prefix plus its own 16-token tail. Prints min / median / max of the per-repeat
medians and the warm / cold ratios; writes ``OUT/prefix.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from specmesh.bench.metrics import spread
from specmesh.bench.report import write_json
from specmesh.defaults import default_models
from specmesh.protocol.config import SpecParams

SPEC = SpecParams(num_steps=5, topk=4, num_draft_tokens=8)
PREFIX_LEN, TAIL_LEN, NEW_TOKENS = 400, 16, 16


def prompts(num_requests: int) -> list[list[int]]:
    """The prefix-filling request, then ``num_requests`` sharing its prefix."""
    from specmesh.bench.workloads import load_workload
    from specmesh.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_models().target)
    texts = load_workload("code", tokenizer, num_requests + 2, PREFIX_LEN).prompts
    prefix = texts[0]
    return [prefix + t[:TAIL_LEN] for t in texts[1:]]


async def side(cache_tokens: int, batch: list[list[int]], device: str) -> dict[str, list[float]]:
    """One deployment: per request after the first, seconds to token 1 and to token 16."""
    import grpc

    from specmesh.bench.stacks import local_deployment
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.rpc.wire import sampling_to_pb
    from specmesh.v1 import generation_pb2, generation_pb2_grpc

    runtime = {"dtype": "fp32", "device": device, "prefix_cache_tokens": cache_tokens}
    params = sampling_to_pb(SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    out: dict[str, list[float]] = {"ttft_s": [], "t16_s": [], "cached": []}
    deployment = local_deployment(default_models(), SPEC, runtime)
    async with deployment as cluster, grpc.aio.insecure_channel(cluster.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for i, ids in enumerate(batch):
            started, first, got = time.perf_counter(), None, 0
            request = generation_pb2.GenerateRequest(prompt_token_ids=ids, sampling=params)
            async for response in stub.Generate(request):
                got += len(response.token_ids)
                if first is None and got:
                    first = time.perf_counter() - started
                if response.finish_reason:
                    cached = response.stats.cached_tokens
            if i:  # the first request fills the cache
                out["ttft_s"].append(first or 0.0)
                out["t16_s"].append(time.perf_counter() - started)
                out["cached"].append(cached)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.prefix", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench_results/prefix"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="the services' device (cpu, cuda)")
    args = parser.parse_args(argv)
    batch = prompts(args.requests)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for repeat in range(args.repeats):
        for name, tokens in (("cold", 0), ("warm", 32768)):
            res = asyncio.run(side(tokens, batch, args.device))
            runs[name].append(res)
            print(f"[prefix {repeat + 1}/{args.repeats}] {name}: ttft "
                  f"{1e3 * statistics.median(res['ttft_s']):.1f} ms, 16 tokens "
                  f"{1e3 * statistics.median(res['t16_s']):.1f} ms, cached {res['cached']}",
                  file=sys.stderr, flush=True)  # fmt: skip
    table = {}
    for metric in ("ttft_s", "t16_s"):
        med = {n: [statistics.median(r[metric]) for r in runs[n]] for n in runs}
        ratios = [w / c for w, c in zip(med["warm"], med["cold"], strict=True)]
        table[metric] = {"cold": spread(med["cold"]), "warm": spread(med["warm"]),
                         "ratio": spread(ratios)}  # fmt: skip
    write_json({"runs": runs, "table": table}, args.out / "prefix.json")
    print("| metric | cold ms | warm ms | warm / cold |\n|---|---|---|---|")
    for metric, row in table.items():
        cold, warm, r = row["cold"], row["warm"], row["ratio"]
        print(f"| {metric} | {1e3 * cold['median']:.1f} ({1e3 * cold['min']:.1f} - "
              f"{1e3 * cold['max']:.1f}) | {1e3 * warm['median']:.1f} ({1e3 * warm['min']:.1f} - "
              f"{1e3 * warm['max']:.1f}) | {r['median']:.2f} ({r['min']:.2f} - {r['max']:.2f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
