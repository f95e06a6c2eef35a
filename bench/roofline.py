"""Decode step time of a target against its physical limit: the bytes one step must read
(every weight but the embedding table, plus the KV cache) divided by the GPU's memory bandwidth.

    python -m specmesh.bench.roofline --target-model DIR [--attention-backend triton]
        [--batch-sizes 1,8,32] [--context 512] [--steps 100]

Times ``TargetRuntime.decode`` (what the target service runs per plain round: the forward in a
CUDA graph when enabled, sampling, the host copy of the tokens) with the device synchronized
around the loop, and reports it as a percentage of the bound, for both the bandwidth measured
here (a device-to-device copy, bytes read + written) and the given nominal one. Prints a JSON
object. ``--profile FILE`` also runs ``torch.profiler`` over the decode steps of each batch
size of ``--profile-batch`` (default the first; ``FILE`` gains ``-bN`` when there are several)
and writes its table of kernels and host calls there, with the GPU's busy time per step set
against the step's wall time in the JSON (what the step loses outside the kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from specmesh.bench.report import emit_json
from specmesh.kernels import attention as attention_kernel
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.runtime.kv_budget import slot_bytes
from specmesh.runtime.models.moe import MoE
from specmesh.target_service.runtime import TargetRuntime


def copy_bandwidth(device: str, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes per second moved by a device-to-device copy (read + write), best of ``repeats``."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def step_bytes(rt: TargetRuntime, batch: int, context: int) -> int:
    """Bytes a decode step reads at least: weights except the embedding table (only ``batch``
    rows of it) and, in a mixture of experts, only the experts the batch's tokens choose (their
    expected number when each token picks ``k`` of ``E`` at random: ``E (1 - (1 - k/E)^batch)``),
    and the KV of ``context`` tokens per request in every layer (K and V, or one latent vector
    with multi-head latent attention)."""
    mc = rt.model_config
    weights = sum(p.numel() * p.element_size() for p in rt.model.parameters())
    elt = torch.finfo(mc.dtype).bits // 8
    embed = mc.vocab_size * mc.hidden_size * elt
    unread = sum(unread_expert_bytes(m, batch) for m in rt.model.modules() if isinstance(m, MoE))
    latent = mc.kv_latent_dim is not None
    kv = batch * context * slot_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, latent)
    return weights - embed - unread + batch * mc.hidden_size * elt + kv


def unread_expert_bytes(moe: MoE, batch: int) -> int:
    """The bytes of the routed experts a batch's decode step leaves unread, expected."""
    experts = len(moe.experts)
    k = moe.gate.moe.num_experts_per_tok
    read = experts * (1 - (1 - k / experts) ** batch)
    total = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    return int(total * (1 - read / experts))


@contextlib.contextmanager
def decoding(rt: TargetRuntime, batch: int, context: int, steps: int) -> Iterator[list[str]]:
    """``batch`` requests prefilled with ``context`` tokens and warmed up, released on exit."""
    params = SamplingParams(max_new_tokens=steps + 16, ignore_eos=True)
    rids = [f"r{batch}-{i}" for i in range(batch)]
    prompt = [(7 * i) % 1000 + 3 for i in range(context)]
    out = rt.prefill([PrefillInput(rid, prompt, params) for rid in rids])
    assert not out.errors, out.errors
    try:
        for _ in range(5):  # warm-up
            rt.decode(rids)
        yield rids
    finally:
        for rid in rids:
            rt.release(rid)


def time_steps(rt: TargetRuntime, rids: list[str], steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps, the device synchronized around each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.decode(rids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def graph_launch_ms(rt: TargetRuntime, batch: int, launches: int = 10) -> float | None:
    """Host milliseconds one launch of the decode graph of ``batch`` takes (median; the device
    synchronized before each): the host time a step spends submitting its graph, which no
    kernel overlaps while the step before it has ended. Replays the last step's buffers as
    they are (the same K/V written to the same slots). None without CUDA graphs."""
    if rt.graphs is None or batch not in rt.graphs.decode.graphs:
        return None
    graph, times = rt.graphs.decode.graphs[batch], []
    for _ in range(launches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def profile_decode(rt: TargetRuntime, batch: int, context: int, steps: int, path: str) -> dict:
    """Profile ``steps`` decode steps; write the table to ``path``; busy vs wall per step."""
    from torch.profiler import ProfilerActivity, profile

    with (
        decoding(rt, batch, context, steps) as rids,
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        wall = sum(time_steps(rt, rids, steps))
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(f"{rt.cfg.attention_backend}, cuda_graph={rt.graphs is not None}, "
                f"fused_kernels={rt.model.fused}, "
                f"batch {batch}, {steps} decode steps\n")  # fmt: skip
        f.write(table)
    launch_us = sum(e.self_cpu_time_total for e in events if e.key == "cudaGraphLaunch")
    return {"batch_size": batch, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
            "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
            "graph_launch_ms_per_step": launch_us / 1e3 / steps}  # fmt: skip


def profile_path(path: str, batch: int) -> str:
    """``path`` with ``-b<batch>`` before its extension: one table per profiled batch size."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-b{batch}.{ext}" if dot and "/" not in ext else f"{path}-b{batch}"


# The rated HBM bandwidth of the cards this has run on, TB/s, by a part of the device's name.
NOMINAL_BANDWIDTH_TBS = {"H100 PCIe": 2.0, "H200": 4.8, "H100": 3.35}


def nominal_bandwidth_tbs(device_name: str) -> float | None:
    """The rated bandwidth of the named card, or None for one not in the table."""
    return next((v for k, v in NOMINAL_BANDWIDTH_TBS.items() if k in device_name), None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.attention_tiles:  # the Triton attention kernel's tiles, before any graph captures it
        attention_kernel.DEFAULT_TILES = args.attention_tiles
    rt = TargetRuntime(TargetConfig(
        model_dir=args.target_model, dtype=args.dtype, device="cuda",
        attention_backend=args.attention_backend, cuda_graph=not args.disable_cuda_graph,
        fused_kernels=not args.no_fused_kernels, cuda_graph_max_bs=max(batch_sizes),
        max_context=args.context + args.steps + 64,
        max_requests=max(batch_sizes), num_kv_slots=max(batch_sizes) * (args.context + args.steps + 128),
    ))  # fmt: skip
    measured = copy_bandwidth("cuda")
    device = torch.cuda.get_device_name(0)
    nominal_tbs = args.nominal_bandwidth_tbs or nominal_bandwidth_tbs(device)
    nominal = nominal_tbs * 1e12 if nominal_tbs else None
    rows = []
    for b in batch_sizes:
        with decoding(rt, b, args.context, args.steps) as rids:
            times = time_steps(rt, rids, args.steps)
            launch = graph_launch_ms(rt, b)
        med = statistics.median(times)
        nbytes = step_bytes(rt, b, args.context)
        rows.append({
            "batch_size": b, "step_ms_min": min(times) * 1e3, "step_ms_median": med * 1e3,
            "step_ms_max": max(times) * 1e3, "bytes_per_step": nbytes,
            "bound_ms_measured_bw": nbytes / measured * 1e3,
            "bound_ms_nominal_bw": nbytes / nominal * 1e3 if nominal else None,
            "pct_of_bound_measured_bw": 100 * nbytes / measured / med,
            "pct_of_bound_nominal_bw": 100 * nbytes / nominal / med if nominal else None,
            "tokens_per_s": b / med, "graph_launch_ms": launch,
        })  # fmt: skip
    profiled = []
    if args.profile:
        sizes = [int(b) for b in (args.profile_batch or str(batch_sizes[0])).split(",")]
        for b in sizes:
            path = args.profile if len(sizes) == 1 else profile_path(args.profile, b)
            profiled.append(profile_decode(rt, b, args.context, 20, path))
    return {
        "device": device, "profiles": profiled, "target": args.target_model,
        "dtype": args.dtype, "attention_backend": args.attention_backend,
        "cuda_graph": rt.graphs is not None, "fused_kernels": rt.model.fused,
        "attention_tiles": attention_kernel.DEFAULT_TILES,
        "context": args.context, "steps": args.steps,
        "copy_bandwidth_tbs": measured / 1e12, "nominal_bandwidth_tbs": nominal_tbs,
        "rows": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target-model", required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--no-fused-kernels", action="store_true", help="the unfused decoder ops")
    p.add_argument("--attention-tiles", choices=attention_kernel.TILES,
                   help="the Triton attention kernel's tiles (default: the kernel's default)")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per batch size")
    p.add_argument(
        "--nominal-bandwidth-tbs",
        type=float,
        help="the card's rated bandwidth (default: by its name, H100 3.35, H200 4.8)",
    )
    p.add_argument("--profile", help="write a torch.profiler table of decode steps here")
    p.add_argument(
        "--profile-batch", help="profile at these batch sizes, e.g. 8,32 (default: the first)"
    )
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    emit_json(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
