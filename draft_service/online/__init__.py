"""Online learning (``specmesh draft --online-learning``): the draft's EAGLE-3 or EAGLE-1 head trains on
the (feature, token) rows of the traffic it serves, off the critical path, guarded against
updates that lower acceptance, checkpointed in the format the draft loads. Output never
changes: the target verifies every draft token. docs/online-learning.md says what it stores.

    settings.py     `OnlineSettings`, the kinds that can learn (torch-free)
    buffer.py       the rows kept: training requests and held-out ones
    head.py         the training-time-test forward and loss on the served module's layers
    guard.py        simulated acceptance on held-out rows: keep, roll back, or reset
    checkpoints.py  --online-learning-dir: EAGLE-3 checkpoints and `latest`
    learner.py      `OnlineLearner`: the trainer thread and the swap between draft steps
    metrics.py      its Prometheus series
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specmesh.draft_service.online.settings import OnlineSettings, refuse_kind

if TYPE_CHECKING:
    from specmesh.draft_service.online.learner import OnlineLearner
    from specmesh.draft_service.runtime import DraftRuntime

__all__ = ["OnlineSettings", "attach_learner", "refuse_kind"]


def attach_learner(
    runtime: DraftRuntime, settings: OnlineSettings | None = None, start: bool = True
) -> OnlineLearner:
    """Give ``runtime`` a learner (resumed from ``cfg.online_learning_dir``'s last checkpoint,
    if any) and start its thread unless ``start`` is False (tests call `update` themselves)."""
    from specmesh.draft_service.models.eagle1 import parse_eagle1_config
    from specmesh.draft_service.models.eagle3 import parse_eagle3_config
    from specmesh.draft_service.online.checkpoints import Checkpoints
    from specmesh.draft_service.online.learner import OnlineLearner

    cfg = runtime.cfg
    refuse_kind(cfg.kind)
    settings = settings or OnlineSettings()
    checkpoints = None
    if cfg.online_learning_dir:
        parse = parse_eagle3_config if cfg.kind == "eagle3" else parse_eagle1_config
        dtype = parse(cfg.draft_dir).base.dtype  # the shipped checkpoint's
        checkpoints = Checkpoints(
            cfg.online_learning_dir, cfg.draft_dir, dtype, settings.keep_checkpoints
        )
    learner = OnlineLearner(runtime.drafter.net, settings, checkpoints, cfg.spec.topk)
    runtime.learner = learner
    if start:
        learner.start()
    return learner
