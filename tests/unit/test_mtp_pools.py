"""MTP / multi-layer EAGLE: every draft step runs in its own layer's KV pool (DESIGN.md §4,
invariant 4; SGLang PR #22954, where steps silently shared one pool)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmesh.draft_service.mtp_drafter import MTPDrafter
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.features import Feature
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.tiny import make_tiny_target
from specmesh.runtime.tiny_drafts import make_tiny_draft

NUM_LAYERS = 3
PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mtp")
    target = make_tiny_target(root / "target", num_hidden_layers=2)
    draft = make_tiny_draft(root / "mtp", target, "mtp", num_nextn_predict_layers=NUM_LAYERS)
    return target, draft


def make_drafter(dirs, spec: SpecParams, static: bool = False) -> MTPDrafter:
    """Built from directories: the target's embedding and head are read from its checkpoint.
    ``static``: decode steps through the static-shape runners (the service default), whose
    pools are bound when they are built; else ragged, asking `pools_for_step` at every step."""
    target, draft = dirs
    cfg = DraftConfig("mtp", str(draft), str(target), spec, max_requests=4, max_context=64,
                      cuda_graph=static)  # fmt: skip
    drafter = load_draft(cfg).drafter
    assert isinstance(drafter, MTPDrafter) and drafter.needs.feature is Feature.HIDDEN_PRE_NORM
    return drafter


def extend(drafter: MTPDrafter, rid: str = "r") -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(len(PROMPT), 64, generator=g)
    drafter.extend([ExtendInput(rid, PROMPT, 17, feats, new=True)])


def record_pools(drafter: MTPDrafter) -> list[tuple[int, int]]:
    """Wrap `pools_for_step`: every call appends (step, K pool data_ptr)."""
    calls: list[tuple[int, int]] = []
    original = drafter.pools_for_step

    def recording(step: int):
        pools = original(step)
        calls.extend((step, p.k.data_ptr()) for p in pools)
        return pools

    drafter.pools_for_step = recording
    return calls


@pytest.mark.parametrize("steps", [3, 5])  # L >= steps, and wrapping around the layers
def test_each_step_gets_its_own_pool(dirs, steps):
    drafter = make_drafter(dirs, SpecParams(steps, 2, 6))
    calls = record_pools(drafter)
    extend(drafter)
    drafter.propose(["r"], [17])
    by_step = dict(calls)
    assert sorted(by_step) == list(range(steps))  # extend: layers 0..L-1, propose: steps 1..S-1
    for a in by_step:
        for b in by_step:
            same_layer = a % NUM_LAYERS == b % NUM_LAYERS
            assert (by_step[a] == by_step[b]) == same_layer, (a, b)
    assert len(set(by_step.values())) == min(steps, NUM_LAYERS)


@pytest.mark.parametrize("steps", [3, 5])
def test_each_step_runner_writes_its_own_layers_pool(dirs, steps):
    """The static-shape path: one runner per layer, bound to that layer's pool alone; steps of
    one layer share it; the tree is the ragged path's."""
    spec = SpecParams(steps, 2, 6)
    ragged = make_drafter(dirs, spec)
    extend(ragged)
    drafter = make_drafter(dirs, spec, static=True)
    extend(drafter)
    runners = drafter.step_graphs.runners
    for step in range(1, steps):
        own = drafter.cache.pools[step % NUM_LAYERS]
        assert [p.k.data_ptr() for p in runners[step].kv_pools] == [own.k.data_ptr()]
        assert [p.v.data_ptr() for p in runners[step].kv_pools] == [own.v.data_ptr()]
    assert len({id(r) for r in runners.values()}) == min(steps - 1, NUM_LAYERS)
    assert drafter.propose(["r"], [17]) == ragged.propose(["r"], [17])


def test_unused_layers_get_no_pool(dirs):
    drafter = make_drafter(dirs, SpecParams(2, 1, 3))
    assert len(drafter.cache.pools) == 2  # layer 2 never runs with two steps


def test_shared_pool_is_caught(dirs, monkeypatch):
    drafter = make_drafter(dirs, SpecParams(3, 2, 6))
    extend(drafter, "ok")
    shared = drafter.cache.pools[0]
    monkeypatch.setattr(drafter, "pools_for_step", lambda step: [shared])
    with pytest.raises(RuntimeError, match="invariant 4"):
        drafter.propose(["ok"], [17])
    with pytest.raises(RuntimeError, match="invariant 4"):
        extend(drafter, "new")


def test_aliased_pools_are_refused(dirs):
    drafter = make_drafter(dirs, SpecParams(3, 1, 4))
    cache = drafter.cache
    cache.pools[1] = cache.pools[0]
    with pytest.raises(ValueError, match="share a KV pool"):
        MTPDrafter(drafter.net, cache, drafter.backend, drafter.spec)
