"""Per-row failure isolation: a request whose forward raises (a bug, or input no check caught)
fails alone with INTERNAL, leaves nothing allocated, and the rest of its batch is served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.target_service import batching
from specmesh.target_service import verify as target_verify
from specmesh.target_service.runtime import TargetRuntime


def _raise_for(rid: str, inner):
    def forward(*args, **kwargs):
        items = args[3] if len(args) > 3 else kwargs["items"]
        if any(it.rid == rid for it in items):
            raise RuntimeError("boom")
        return inner(*args, **kwargs)

    return forward


def test_draft_row_whose_forward_raises_fails_alone(tiny_dir: Path) -> None:
    cfg = DraftConfig(
        "eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), SpecParams(3, 2, 6)
    )
    rt = load_draft(cfg)
    real = rt.drafter.extend

    def extend(inputs: list[ExtendInput]) -> None:
        if any(i.rid == "bad" for i in inputs):
            for i in inputs:  # fail after the drafter created its rows, as a forward would
                if i.new and i.rid not in rt.drafter.cache.requests:
                    rt.drafter.cache.add(i.rid)
            raise RuntimeError("boom")
        real(inputs)

    rt.drafter.extend = extend
    width = 3 * rt.target.hidden_size
    rows = {"a": [5, 6, 7], "bad": [5, 6], "b": [9]}
    res = rt.step(
        [ExtendInput(r, ids, 11, torch.randn(len(ids), width), new=True) for r, ids in rows.items()]
    )
    assert set(res.trees) == {"a", "b"} and set(res.errors) == {"bad"}
    assert res.errors["bad"].grpc_code == "INTERNAL" and "boom" in str(res.errors["bad"])
    assert set(rt.live) == {"a", "b"} and set(rt.drafter.cache.requests) == {"a", "b"}


@pytest.fixture
def target(tiny_dir: Path) -> TargetRuntime:
    return TargetRuntime(TargetConfig(str(tiny_dir / "target"), num_kv_slots=512))


def _break_row(monkeypatch: pytest.MonkeyPatch, rid: str) -> None:
    """Every target forward that includes ``rid`` raises from now on."""
    for module in (target_verify, batching):  # verify, prefill
        monkeypatch.setattr(module, "run_batch", _raise_for(rid, module.run_batch))


def test_target_prefill_row_whose_forward_raises_fails_alone(
    target: TargetRuntime, oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    _break_row(monkeypatch, "bad")
    params = SamplingParams()
    out = target.prefill([PrefillInput(r, [5, 6, 7], params) for r in ("a", "bad", "b")])
    assert set(out.tokens) == {"a", "b"} and out.errors["bad"].grpc_code == "INTERNAL"
    assert set(target.requests) == set(target.cache.requests) == {"a", "b"}
    first = oracle(target.cfg.model_dir, [5, 6, 7], 1)
    assert out.tokens["a"] == out.tokens["b"] == first


def test_target_verify_row_whose_forward_raises_fails_alone(
    target: TargetRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    target.prefill([PrefillInput(r, [5, 6, 7], SamplingParams()) for r in ("a", "bad")])
    _break_row(monkeypatch, "bad")
    trees = [VerifyInput(r, DraftTree.chain([target.requests[r].pending, 9])) for r in ("a", "bad")]
    out = target.verify(trees)
    assert set(out.tokens) == {"a"} and out.errors["bad"].grpc_code == "INTERNAL"
    assert set(target.requests) == set(target.cache.requests) == {"a"}
