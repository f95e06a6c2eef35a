"""Operators a draft round dispatches outside its captured forwards: the host work of drafting.

    python -m specmesh.bench.draft_ops [--batch-size 1] [--rounds 5] [--top 25]

On a GPU the draft's round is host-bound (bench_results/gpu/round3: 6.3 ms of host time a
round for 2.0 ms of device work at batch 1), and every operator the host dispatches costs a few
microseconds of it, a kernel launch for most. This counts them on the CPU, where the count is
the same and deterministic: the tiny EAGLE-3 pair of `bench.hop`, the draft's steps through its
static-shape runners and its search graph (the GPU path; each runner's forward and the
search's body, graph replays there, are not counted), one extend of 3 tokens and a 5/4/8 tree per request per round, per stage (extend,
propose, each expand step) and operator. Reads of a tensor's values on the host (``tolist``,
``item``: a device-to-host copy and a sync on a GPU) are counted beside them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SPEC = (5, 4, 8)
# What ``numpy()`` and ``tolist()`` dispatch on a tensor with neither bit set: nothing is done.
NO_OPS = (torch.ops.aten.resolve_conj.default, torch.ops.aten.resolve_neg.default)
HOST_READS = ("tolist", "item")
STAGES = (
    ("specmesh.draft_service.runtime", "DraftRuntime", "_extend", "extend"),
    ("specmesh.draft_service.runtime", "DraftRuntime", "_propose", "propose"),
    ("specmesh.draft_service.drafter", "TreeDrafter", "_expand", "expand"),
)


class OpCount(TorchDispatchMode):
    """Operators dispatched on this thread while on, by (stage, operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.on, self.stage = True, "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func not in NO_OPS:
            self.counts[(self.stage, str(func).removeprefix("aten."))] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def patched(
    count: OpCount, stages: tuple[tuple[str, str | None, str, str], ...] = STAGES
) -> Iterator[None]:
    """``stages`` tagged (module, class or None for a module's function, name, label), and the
    runners' forwards and the search body (graph replays on a GPU) not counted."""
    import importlib

    from specmesh.draft_service.search_graph import SearchGraphs
    from specmesh.runtime.graph_runner import GraphRunner

    saved: list[tuple[object, str, Callable]] = []

    def quiet(fn):
        def run(self, *args, **kwargs):
            outer, count.on = count.on, False
            try:
                return fn(self, *args, **kwargs)
            finally:
                count.on = outer

        return run

    def tagged(fn, label: str):
        def run(self, *args, **kwargs):
            outer, count.stage = count.stage, label
            try:
                return fn(self, *args, **kwargs)
            finally:
                count.stage = outer

        return run

    def host_read(fn, label: str):
        def read(self, *args, **kwargs):  # counted inside the captured parts too: there a
            count.counts[(count.stage, label)] += 1  # read would break the capture on a GPU
            return fn(self, *args, **kwargs)

        return read

    targets = [(GraphRunner, "_forward", quiet), (SearchGraphs, "_search", quiet)]
    for name in HOST_READS:  # no operator on CPU, a device-to-host copy and sync on a GPU
        targets.append((torch.Tensor, name, lambda fn, n=name: host_read(fn, f"{n} (host read)")))
    for module, cls, name, label in stages:
        owner = importlib.import_module(module)
        owner = owner if cls is None else getattr(owner, cls)
        targets.append((owner, name, lambda fn, label=label: tagged(fn, label)))
    for owner, name, wrap in targets:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def count_round_ops(models_dir: Path, batch_size: int, rounds: int) -> collections.Counter:
    """(stage, operator) -> operators dispatched per round, averaged over ``rounds``."""
    from specmesh.bench.hop import build_models
    from specmesh.draft_service.runtime import load_draft
    from specmesh.protocol.config import DraftConfig, SpecParams
    from specmesh.protocol.steps import ExtendInput

    models = build_models(models_dir)
    runtime = load_draft(DraftConfig("eagle3", models.draft, models.target, SpecParams(*SPEC),
                                     num_kv_slots=8192))  # fmt: skip
    runtime.drafter.enable_step_graphs("eager-static", max(8, batch_size))
    width = runtime.drafter.net.feature_width
    gen = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(batch_size)]
    rows = lambda n: torch.randn(n, width, generator=gen)
    runtime.step([ExtendInput(r, list(range(3, 40)), 50, rows(37), new=True) for r in rids])
    count = OpCount()
    with patched(count), count:
        for _ in range(rounds):
            runtime.step([ExtendInput(r, [50, 51, 52], 53, rows(3)) for r in rids])
    return collections.Counter({k: v / rounds for k, v in count.counts.items()})


def split_reads(counts: collections.Counter) -> tuple[collections.Counter, collections.Counter]:
    """(operators, host reads by stage) of `count_round_ops`' counts."""
    ops, reads = collections.Counter(), collections.Counter()
    for (stage, op), n in counts.items():
        if op.endswith("(host read)"):
            reads[stage] += n
        else:
            ops[(stage, op)] += n
    return ops, reads


def parse_args(prog: str, doc: str, batch_size: int, argv: list[str] | None) -> argparse.Namespace:
    """The command line of an operator count (this one's, `bench.verify_ops`')."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="operators listed")
    p.add_argument("--models", help="where the tiny pair is built (default: a temp dir)")
    return p.parse_args(argv)


def report(counts: collections.Counter, batch_size: int, what: str, top: int) -> None:
    """The total of ``counts`` (``what``: what they are counted for), per stage, and the
    ``top`` (stage, operator) rows."""
    ops, reads = split_reads(counts)
    stages = collections.Counter()
    for (stage, _), n in ops.items():
        stages[stage] += n
    print(f"batch {batch_size}: {sum(ops.values()):.0f} operators {what} "
          f"({', '.join(f'{s} {n:.0f}' for s, n in stages.most_common())}); "
          f"host reads: {dict(reads) or 'none'}")  # fmt: skip
    for (stage, op), n in counts.most_common(top):
        print(f"  {stage:8s} {op:44s} {n:6.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args("specmesh.bench.draft_ops", __doc__, 1, argv)
    counts = count_round_ops(Path(args.models or tempfile.mkdtemp()), args.batch_size, args.rounds)
    report(counts, args.batch_size, "a round outside the captured forwards", args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
