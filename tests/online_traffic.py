"""Helpers of the online-learning tests: small settings, a guard that keeps every update, an
engine on the copy pair whose draft learns (its learner not started: tests call `update`)."""

from __future__ import annotations

from pathlib import Path

import torch

from specmesh.draft_service.online import OnlineSettings, attach_learner
from specmesh.draft_service.online.guard import Score, Verdict
from specmesh.protocol.config import SpecParams
from specmesh.router.engine import Engine

SETTINGS = OnlineSettings(
    update_tokens=64, steps_per_update=4, heldout_every=3, min_heldout_rounds=8,
    window_tokens=32, batch_windows=2, lr=1e-3,
)  # fmt: skip


class KeepAll:
    """A guard that keeps every update: a new version is served whatever it scores."""

    def judge(self, *args) -> Verdict:
        nothing = Score(0, 1)
        return Verdict(nothing, nothing, nothing, keep=True, rewind=False, reset=False)


def learning_engine(copy_dir: Path, settings: OnlineSettings = SETTINGS, kind: str = "eagle3"):
    """(engine, learner) on the copy pair's target and its EAGLE-3 (or ``kind``) draft."""
    engine = Engine(copy_dir / "target", draft_model=copy_dir / kind, draft_kind=kind,
                    spec=SpecParams(3, 4, 8))  # fmt: skip
    return engine, attach_learner(engine.draft, settings, start=False)


def prompts(count: int, seed: int, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(count)]
