"""The Triton paged-attention kernel's time per decode step against the bytes it must read, per
tile variant (`kernels.attention.TILES`), on a CUDA GPU.

    python -m specmesh.bench.attention_speed [--batch-sizes 1,8,32] [--contexts 512,2048]
        [--tree-rows 8] [--layers 32] [--out FILE]

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


def time_step(args: argparse.Namespace, batch: int, context: int, q_rows: int) -> list[dict]:
    """Each tile variant's step time for one shape, the variants interleaved per repeat."""
    import triton.testing

    dev, dtype = "cuda", getattr(torch, args.dtype)
    meta = batch_metadata(batch, context, q_rows, dev)
    slots = batch * context
    pools = [
        torch.randn(2, slots, args.kv_heads, args.head_dim, device=dev, dtype=dtype)
        for _ in range(args.layers)
    ]
    q = torch.randn(batch * q_rows, args.heads, args.head_dim, device=dev, dtype=dtype)
    scale = args.head_dim**-0.5

    def step(tiles: str) -> None:
        for kv in pools:
            paged_attention_triton(q, kv[0], kv[1], meta, scale, tiles=tiles)

    times: dict[str, list[float]] = {t: [] for t in TILES}
    for _ in range(args.repeats):
        for tiles in TILES:
            times[tiles].append(triton.testing.do_bench_cudagraph(lambda t=tiles: step(t)))
    nbytes = 2 * slots * args.kv_heads * args.head_dim * pools[0].element_size() * args.layers
    rows = []
    for tiles, ms in times.items():
        med = statistics.median(ms)
        rows.append({
            "tiles": tiles, "batch_size": batch, "context": context, "q_rows": q_rows,
            "step_us_median": med * 1e3, "step_us_min": min(ms) * 1e3,
            "step_us_max": max(ms) * 1e3, "kv_bytes": nbytes, "gb_per_s": nbytes / med / 1e6,
        })  # fmt: skip
        print(f"{'decode' if q_rows == 1 else 'verify'} b{batch} ctx {context} {tiles}: "
              f"{med * 1e3:.1f} us ({min(ms) * 1e3:.1f} - {max(ms) * 1e3:.1f}), "
              f"{nbytes / med / 1e6:.0f} GB/s", flush=True)  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            rows += time_step(args, batch, context, 1)
            if args.tree_rows > 1:
                rows += time_step(args, batch, context, args.tree_rows)
    return {"device": torch.cuda.get_device_name(0), "dtype": args.dtype, "heads": args.heads,
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    emit_json(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
