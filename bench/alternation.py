"""What passing the turn between two processes costs on this machine before any wire: the same
Python + torch work done in one process, and split in two halves between two processes that
pass the turn over a pipe (one byte each way), as a cluster's target and draft pass a round.

    python -m specmesh.bench.alternation [--layers 15 | --round-ms MS] [--rounds 200]
        [--repeats 3] [--pin]

The work is a small transformer layer's forwards (64 wide, 9 rows: many small operators and
Python calls, as a round of `bench.hop`'s near-free pair is), ``--layers`` of them per half,
or as many as make a one-process round of about ``--round-ms`` (`bench.hop` sizes it to each
mode's in-process round and prints the ratio beside its own).
``--pin`` places the sides as `bench.hop --pin` does: the one process on core 0; the two on
cores 0 and 1, with this driver on core 1. Every (side, repeat) runs in fresh processes, the
repeats interleaved. The ratio (one process's round / two processes' round) is what taking
turns alone costs: a cluster round that calls its services one after the other cannot beat it
here, whatever its wire costs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from specmesh.bench.metrics import ratio_spread, spread

WARM_UP = 20
ROUNDS = 200
TURN, STOP = b"t", b""


def _work(layers: int) -> Callable[[], object]:
    """``layers`` forwards of a small transformer layer."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    x = torch.randn(1, 9, 64)

    @torch.inference_mode()
    def run() -> object:
        y = x
        for _ in range(layers):
            y = layer(y)
        return y

    return run


def _place(cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def _worker(cpus: list[int] | None) -> None:
    """A measuring process: on ``cpus``, one torch thread (as each model service of a cluster
    on two cores)."""
    import torch

    _place(cpus)
    torch.set_num_threads(1)


def _take_turns(conn: Connection, cpus: list[int] | None, layers: int) -> None:
    """A half: its work each time it is given the turn, then the turn back."""
    _worker(cpus)
    work = _work(layers)
    while conn.recv_bytes() == TURN:
        work()
        conn.send_bytes(TURN)


def _alone(conn: Connection, cpus: list[int] | None, layers: int, rounds: int) -> None:
    """Both halves in this one process, round after round; sends the rounds' seconds."""
    _worker(cpus)
    first, second = _work(layers), _work(layers)
    seconds = []
    for i in range(WARM_UP + rounds):
        started = time.perf_counter()
        first()
        second()
        if i >= WARM_UP:
            seconds.append(time.perf_counter() - started)
    conn.send(seconds)


def one_process(layers: int, rounds: int, pin: bool) -> float:
    """Median ms a round, both halves in one fresh process."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_alone, args=(theirs, [0] if pin else None, layers, rounds))
    proc.start()
    seconds = mine.recv()
    proc.join()
    return 1e3 * statistics.median(seconds)


def two_processes(layers: int, rounds: int, pin: bool) -> float:
    """Median ms a round, each half in a fresh process of its own, this one passing the turn."""
    ctx = mp.get_context("spawn")
    placed = os.sched_getaffinity(0)
    pipes, procs = [], []
    for cpus in ([0], [1]) if pin else (None, None):
        mine, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=_take_turns, args=(theirs, cpus, layers)))
        procs[-1].start()
        pipes.append(mine)
    _place([1] if pin else None)
    try:
        seconds = []
        for i in range(WARM_UP + rounds):
            started = time.perf_counter()
            for conn in pipes:
                conn.send_bytes(TURN)
                conn.recv_bytes()
            if i >= WARM_UP:
                seconds.append(time.perf_counter() - started)
    finally:
        os.sched_setaffinity(0, placed)
        for conn in pipes:
            conn.send_bytes(STOP)
        for proc in procs:
            proc.join()
    return 1e3 * statistics.median(seconds)


def layers_for(round_ms: float) -> int:
    """Layer forwards per half that make a one-process round of about ``round_ms`` here (the
    fastest of 100 forwards: what another process's load cannot inflate)."""
    work = _work(1)
    for _ in range(WARM_UP):
        work()
    seconds = []
    for _ in range(100):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return max(1, round(round_ms / 2 / (1e3 * min(seconds))))


def _sizer(conn: Connection, cpus: list[int] | None, round_ms: float) -> None:
    _worker(cpus)
    conn.send(layers_for(round_ms))


def sized(round_ms: float, pin: bool) -> int:
    """`layers_for` in a fresh process placed as the one-process side is."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sizer, args=(theirs, [0] if pin else None, round_ms))
    proc.start()
    layers = mine.recv()
    proc.join()
    return layers


def measure(layers: int = 15, rounds: int = ROUNDS, repeats: int = 3, pin: bool = False) -> dict:
    """Both sides, ``repeats`` times interleaved (`summary`)."""
    if pin and not {0, 1} <= os.sched_getaffinity(0):
        raise ValueError("--pin needs cores 0 and 1")
    runs = [once(layers, rounds, pin) for _ in range(repeats)]
    return summary(runs, layers, rounds, pin)


def once(layers: int, rounds: int = ROUNDS, pin: bool = False) -> tuple[float, float]:
    """One repeat: (one process, two processes) median ms a round."""
    return one_process(layers, rounds, pin), two_processes(layers, rounds, pin)


def summary(
    runs: list[tuple[float, float]], layers: int | list[int], rounds: int, pin: bool
) -> dict:
    """ms a round of each side (min / median / max over the repeats) and the ratio one process
    / two processes (of the medians, with the per-repeat min / max)."""
    alone, apart = [r[0] for r in runs], [r[1] for r in runs]
    # rounds per second of two processes over one's
    ratio = ratio_spread([1 / ms for ms in apart], [1 / ms for ms in alone])
    return {"layers": layers, "rounds": rounds, "pin": pin, "one_process_ms": spread(alone),
            "two_processes_ms": spread(apart), **ratio}  # fmt: skip


def format_alternation(a: dict[str, Any]) -> str:
    one, two = a["one_process_ms"], a["two_processes_ms"]
    return "\n".join([
        "| taking turns, no wire | ms a round, median (min - max) |", "|---|---|",
        f"| one process | {one['median']:.2f} ({one['min']:.2f} - {one['max']:.2f}) |",
        f"| two processes | {two['median']:.2f} ({two['min']:.2f} - {two['max']:.2f}) |",
        f"| one / two | {a['ratio']:.2f} ({a['ratio_min']:.2f} - {a['ratio_max']:.2f}) |",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmesh.bench.alternation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    size = p.add_mutually_exclusive_group()
    size.add_argument("--layers", type=int, default=15, help="layer forwards per half")
    size.add_argument("--round-ms", type=float, help="the layers of a one-process round this long")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pin", action="store_true", help="bench.hop --pin's placement")
    args = p.parse_args(argv)
    if min(args.layers, args.rounds, args.repeats) < 1 or (args.round_ms or 1) <= 0:
        p.error("--layers, --rounds and --repeats must be >= 1, --round-ms > 0")
    if args.round_ms:
        args.layers = sized(args.round_ms, args.pin)
    print(format_alternation(measure(args.layers, args.rounds, args.repeats, args.pin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
