"""The Triton paged-attention kernel's time per decode step against the bytes it must read, per
tile variant (`kernels.attention.TILES`), on a CUDA GPU.

    python -m specmesh.bench.attention_speed [--batch-sizes 1,8,32] [--contexts 512,2048]
        [--tree-rows 8] [--layers 32] [--num-splits 0,4,8] [--out FILE]

One step is the kernel run once per layer over that layer's own K / V pools (Llama-3.1-8B
shapes by default: 32 query heads, 8 kv heads, head_dim 128, bf16), so the step reads more
than the GPU's L2 holds, as a model's does. Each request's slots are scattered over the pool
(a random permutation: pages of one token). Rows ``decode`` have one query row per request;
rows ``verify`` have ``--tree-rows`` under a tree mask (a chain's lower triangle), as a
speculative round's verify has. Timed as CUDA-graph replays (`triton.testing`), median and
min / max of ``--repeats``; prints JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specmesh.bench.report import emit_json
from specmesh.kernels.attention import TILES, paged_attention_triton
from specmesh.runtime.attention.base import AttentionMetadata


def batch_metadata(batch: int, context: int, q_rows: int, device: str) -> AttentionMetadata:
    """``batch`` requests of ``context`` kv slots each (their last ``q_rows`` the new rows),
    scattered over a pool of exactly that many slots; a chain's mask when ``q_rows`` > 1."""
    n = batch * context
    slots = torch.randperm(n, device=device)
    cum = lambda step, count: torch.arange(0, (count + 1) * step, step, device=device)
    kv_indptr = cum(context, batch)
    out_slots = slots.view(batch, context)[:, -q_rows:].reshape(-1)
    mask = mask_indptr = None
    if q_rows > 1:
        prefix = torch.ones(q_rows, context - q_rows, dtype=torch.bool, device=device)
        tree = torch.ones(q_rows, q_rows, dtype=torch.bool, device=device).tril()
        mask = torch.cat([prefix, tree], 1).flatten().repeat(batch)
        mask_indptr = cum(q_rows * context, batch)
    return AttentionMetadata(
        qo_indptr=cum(q_rows, batch), kv_indptr=kv_indptr, kv_indices=slots,
        out_slots=out_slots, custom_mask=mask, mask_indptr=mask_indptr,
    )  # fmt: skip


def cuda_graph_ms(fn: Callable[[], None]) -> float:
    """Milliseconds a call of ``fn`` takes, replayed in a CUDA graph (no launch overhead)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn)


def wall_ms(fn: Callable[[], None], calls: int = 1) -> float:
    """Milliseconds a call of ``fn`` takes on the host (CPU: a smoke run, the interpreter)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def time_step(args: argparse.Namespace, batch: int, context: int, q_rows: int) -> list[dict]:
    """Each tile variant's step time for one shape, the variants interleaved per repeat."""
    dev, dtype = args.device, getattr(torch, args.dtype)
    timer = cuda_graph_ms if dev == "cuda" else wall_ms
    meta = batch_metadata(batch, context, q_rows, dev)
    slots = batch * context
    pools = [
        torch.randn(2, slots, args.kv_heads, args.head_dim, device=dev, dtype=dtype)
        for _ in range(args.layers)
    ]
    q = torch.randn(batch * q_rows, args.heads, args.head_dim, device=dev, dtype=dtype)
    scale = args.head_dim**-0.5

    def step(tiles: str, splits: int) -> None:
        for kv in pools:
            paged_attention_triton(q, kv[0], kv[1], meta, scale, splits or None, tiles)

    variants = [(t, s) for t in TILES for s in args.num_splits]
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for tiles, splits in variants:
            bench = lambda t=tiles, s=splits: step(t, s)
            times[tiles, splits].append(timer(bench))
    nbytes = 2 * slots * args.kv_heads * args.head_dim * pools[0].element_size() * args.layers
    rows = []
    for (tiles, splits), ms in times.items():
        med = statistics.median(ms)
        rows.append({
            "tiles": tiles, "num_splits": splits or "default", "batch_size": batch,
            "context": context, "q_rows": q_rows, "step_us_median": med * 1e3,
            "step_us_min": min(ms) * 1e3, "step_us_max": max(ms) * 1e3, "kv_bytes": nbytes,
            "gb_per_s": nbytes / med / 1e6,
        })  # fmt: skip
        print(f"{'decode' if q_rows == 1 else 'verify'} b{batch} ctx {context} {tiles} "
              f"splits {splits or 'default'}: {med * 1e3:.1f} us ({min(ms) * 1e3:.1f} - "
              f"{max(ms) * 1e3:.1f}), {nbytes / med / 1e6:.0f} GB/s", flush=True)  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            rows += time_step(args, batch, context, 1)
            if args.tree_rows > 1:
                rows += time_step(args, batch, context, args.tree_rows)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    return {"device": device, "dtype": args.dtype, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "layers": args.layers,
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.attention_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--tree-rows", type=int, default=8, help="query rows of a verify (1: none)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-splits", default="0", type=lambda v: [int(x) for x in v.split(",")],
                   help="kv splits per row to time, e.g. 0,4,8,16 (0: the kernel's default)")  # fmt: skip
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    emit_json(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
