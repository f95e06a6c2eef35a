"""Operators a target verify dispatches outside its captured forward: the host work of verifying.

    python -m specmesh.bench.verify_ops [--batch-size 8] [--rounds 5] [--top 25]

The target's side of `bench.draft_ops`: the near-free target of `bench.hop`, its verify through
its static-shape runner (the GPU path; the runner's forward, a graph replay there, is not
counted) with EAGLE-3 features on, ``--batch-size`` requests each verifying an 8-node tree per
round, per stage (``rows``: checking the trees and laying out the batch, ``decide``: logits and
acceptance, the read-back and the accepted rows, ``keep``: committing the paths) and operator.
On a GPU most of them are kernel launches or copies of a few microseconds each; what grows with
the batch is per-request work. Counts are deterministic.
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import torch

from specmesh.bench.draft_ops import OpCount, parse_args, patched, report

NUM_NODES = 8
PARENTS = (-1, 0, 0, 1, 1, 2, 3, 5)  # a top-2 tree of 8 nodes
STAGES = (
    ("specmesh.target_service.runtime", "TargetRuntime", "verify", "rows"),
    ("specmesh.target_service.verify", None, "decide", "decide"),
    ("specmesh.target_service.verify", None, "keep", "keep"),
)


def count_verify_ops(models_dir: Path, batch_size: int, rounds: int) -> collections.Counter:
    """(stage, operator) -> operators dispatched per verify, averaged over ``rounds``."""
    from specmesh.bench.hop import AUX_LAYER_IDS, build_models
    from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.protocol.steps import PrefillInput, VerifyInput
    from specmesh.protocol.trees import DraftTree
    from specmesh.target_service.runtime import TargetGraphs, TargetRuntime

    rt = TargetRuntime.from_dir(build_models(models_dir).target)
    rt.configure(FeatureSpec(Feature.AUX_HIDDEN, AuxLayers(AUX_LAYER_IDS, "output")))
    rt.graphs = TargetGraphs(rt.model, rt.cache, rt.backend, mode="eager-static",
                             max_bs=max(8, batch_size), tree_sizes=(NUM_NODES,), aux=rt.aux_layers)  # fmt: skip
    rids = [f"r{i}" for i in range(batch_size)]
    params = SamplingParams(max_new_tokens=8 * (rounds + 1), ignore_eos=True)
    rt.prefill([PrefillInput(r, list(range(3, 40)), params) for r in rids], Feature.AUX_HIDDEN)
    trees = lambda: [VerifyInput(r, DraftTree((rt.requests[r].pending, *[7] * (NUM_NODES - 1)), PARENTS))
                     for r in rids]  # fmt: skip
    rt.verify(trees(), Feature.AUX_HIDDEN)  # warm
    count = OpCount()
    with patched(count, STAGES), count:
        for _ in range(rounds):
            rt.verify(trees(), Feature.AUX_HIDDEN)
    return collections.Counter({k: v / rounds for k, v in count.counts.items()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args("specmesh.bench.verify_ops", __doc__, 8, argv)
    torch.set_num_threads(1)
    counts = count_verify_ops(Path(args.models or tempfile.mkdtemp()), args.batch_size, args.rounds)
    report(counts, args.batch_size, "a verify outside the captured forward", args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
