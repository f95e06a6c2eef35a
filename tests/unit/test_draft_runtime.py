"""DraftRuntime.step: one bad request in a batch does not fail the others or leak KV rows."""

from __future__ import annotations

from pathlib import Path

import torch

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.steps import ExtendInput


def test_bad_extend_is_isolated(tiny_dir: Path) -> None:
    cfg = DraftConfig(
        "eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), SpecParams(2, 2, 4)
    )
    rt = load_draft(cfg)
    width = 3 * 64
    good = ExtendInput("good", [5, 6, 7], 8, torch.randn(3, width), new=True)
    bad = ExtendInput("bad", [5, 6, 7], 8, torch.randn(2, width), new=True)  # 2 rows for 3 tokens
    res = rt.step([good, bad])
    assert set(res.trees) == {"good"} and res.trees["good"].num_nodes == 4
    assert isinstance(res.errors["bad"], InvalidRequestError) and "3 feature rows" in str(
        res.errors["bad"]
    )
    assert set(rt.drafter.cache.requests) == {"good"}
