"""Draft decode steps through static-shape runners (CUDA graphs on a GPU, eager-static on CPU).

Every decode step of a round forwards ``topk`` frontier rows per request with a tree mask, so one
`GraphRunner` sized by `DraftSizes` (invariant 5) serves every step that runs the same network
over the same KV pools: one for EAGLE / EAGLE-3 / standalone drafts, one per MTP layer (each
layer keeps its own pool, invariant 4). Logits are computed inside the captured forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh.draft_service.drafter import RootState, TreeDrafter
from specmesh.draft_service.step_batch import StepBatch
from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.models.layers import KVPair
from specmesh.runtime.static_shapes import DraftSizes, draft_step_sizes


@dataclass
class StepNetwork:
    """What one draft decode step runs: ``forward(**model kwargs) -> (hidden, logits)``."""

    key: object  # steps with equal keys share a runner
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    pools: list[KVPair]
    hidden_in: tuple[int, torch.dtype] | None  # (hidden size, dtype) of the step's input hidden


class _StandaloneStep:
    """A standalone draft LM seen as a step network: its logits, cut to the proposable ids."""

    def __init__(self, drafter: TreeDrafter) -> None:
        self.drafter = drafter

    def __call__(self, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.drafter
        out = d.model(**kwargs)
        return out.hidden, d.model.compute_logits(out.hidden)[:, : d.num_proposable]


def step_network(drafter: TreeDrafter, step: int) -> StepNetwork:
    from specmesh.draft_service.feature_drafter import FeatureDrafter
    from specmesh.draft_service.mtp_drafter import MTPDrafter
    from specmesh.draft_service.standalone import StandaloneDrafter

    if isinstance(drafter, MTPDrafter):
        layer, base = drafter.layer_of(step), drafter.net.config.base
        net = drafter.net.layer_net(layer)
        return StepNetwork(("mtp", layer), net, drafter._pool(step), (base.hidden_size, base.dtype))
    if isinstance(drafter, FeatureDrafter):
        base = drafter.net.config.base
        pools = drafter.pools_for_step(step)
        return StepNetwork("net", drafter.net, pools, (base.hidden_size, base.dtype))
    if isinstance(drafter, StandaloneDrafter):
        return StepNetwork("lm", _StandaloneStep(drafter), drafter.pools_for_step(step), None)
    raise ValueError(f"no static-shape draft steps for {type(drafter).__name__}")


class DraftStepGraphs:
    def __init__(self, drafter: TreeDrafter, *, mode: str, max_bs: int) -> None:
        s = drafter.sizes
        sizes = DraftSizes(min(max_bs, s.max_bs), s.topk, s.num_steps, s.max_context_len)
        self.sizes = draft_step_sizes(sizes)
        self.runners: dict[int, GraphRunner] = {}  # by step
        shared: dict[object, GraphRunner] = {}
        for step in range(1, s.num_steps):
            net = step_network(drafter, step)
            if net.key not in shared:
                shared[net.key] = GraphRunner(
                    net.forward, drafter.cache, drafter.backend, self.sizes, mode=mode,
                    kv_pools=net.pools, hidden_in=net.hidden_in,
                )  # fmt: skip
                shared[net.key].capture()
            self.runners[step] = shared[net.key]

    def batch(
        self,
        drafter: TreeDrafter,
        rids: list[str],
        states: list[RootState],
        num_steps: int,
        hidden_in: torch.Tensor,
    ) -> StepBatch | None:
        """The search's steps laid out in the runners (`StepBatch`), or None where a runner does
        not take the batch (too many requests; the search then runs its steps eagerly)."""
        runners = {step: self.runners[step] for step in range(1, num_steps)}
        for runner in runners.values():
            if not runner.fits(len(rids), _input_hidden(runner, hidden_in)):
                return None
        return StepBatch(drafter, rids, states, num_steps, runners)


def _input_hidden(runner: GraphRunner, hidden_in: torch.Tensor | None) -> torch.Tensor | None:
    """The standalone draft ignores its input hidden; its runner has no buffer for it."""
    return None if runner.buffers.hidden_in is None else hidden_in
