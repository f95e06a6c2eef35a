"""Online learning's lifecycle: checkpoints the draft loads and resumes from (a write killed
midway included), nothing of a request held once it ends or fails, one version per draft step
while the trainer thread publishes, the kinds that refuse the switch, its metrics, and a draft
without the switch that holds no learner at all."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from online_traffic import SETTINGS, KeepAll, learning_engine, prompts

from specmesh.draft_service.online import attach_learner
from specmesh.draft_service.online.checkpoints import Checkpoints
from specmesh.draft_service.online.metrics import OnlineCollector
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput


def _config(copy_dir: Path, **fields) -> DraftConfig:
    return DraftConfig("eagle3", str(copy_dir / "eagle3"), str(copy_dir / "target"),
                       SpecParams(3, 4, 8), num_kv_slots=4096, **fields)  # fmt: skip


def _served(runtime) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in runtime.drafter.net.named_parameters()}


def test_checkpoints_load_as_a_draft_and_a_restart_resumes(copy_dir: Path, tmp_path: Path) -> None:
    engine, learner = learning_engine(copy_dir)
    learner.checkpoints = Checkpoints(tmp_path, copy_dir / "eagle3", torch.float32, keep=2)
    engine.generate(prompts(9, seed=0), SamplingParams(max_new_tokens=24))
    learner.guard = KeepAll()
    for _ in range(3):
        learner.update()  # v1, v2, v3 written; the newest two kept, `latest` names v3
    learner.swap()
    learned = _served(engine.draft)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v000002", "v000003"]
    assert (tmp_path / "latest").resolve().name == "v000003"
    # a write killed midway: a temporary folder, `latest` still naming a whole checkpoint
    (tmp_path / ".v000004.tmp").mkdir()
    (tmp_path / ".v000004.tmp" / "model.safetensors").write_bytes(b"\0" * 7)
    restarted = load_draft(_config(copy_dir, online_learning_dir=str(tmp_path)))
    resumed = attach_learner(restarted, SETTINGS, start=False)
    assert resumed.stats().version == 3 and not (tmp_path / ".v000004.tmp").exists()
    served = _served(restarted)
    assert all(torch.equal(served[k], v) for k, v in learned.items())
    plain = load_draft(replace(_config(copy_dir), draft_dir=str(tmp_path / "latest")))
    assert plain.learner is None  # `specmesh draft --model DIR/latest`: a head like any other
    assert all(torch.equal(p, learned[k]) for k, p in plain.drafter.net.named_parameters())


def test_nothing_of_a_request_is_held_after_it_ends_or_fails(copy_dir: Path) -> None:
    runtime = load_draft(_config(copy_dir))
    learner = attach_learner(runtime, SETTINGS, start=False)
    width = runtime.drafter.net.feature_width
    feats = torch.randn(12, width)
    ok = [ExtendInput(f"r{i}", list(range(3, 15)), 20, feats, new=True) for i in range(3)]
    bad = ExtendInput("bad", list(range(3, 15)), 20, feats[:5], new=True)  # rows missing
    res = runtime.step([*ok, bad])
    assert set(res.errors) == {"bad"} and set(res.trees) == {"r0", "r1", "r2"}
    runtime.step([ExtendInput("r0", [20, 21], 22, feats[:2])])
    for rid in ("r0", "r1", "r2"):
        runtime.release(rid)
    assert runtime.live == {} and learner.buffer.open == {}
    assert runtime.kv_slots()[0] == 0
    assert learner.stats().tokens_observed == 3 * 12 + 2  # the failed request's rows: none


def test_every_draft_step_runs_one_version_while_the_trainer_publishes(copy_dir: Path) -> None:
    settings = replace(SETTINGS, update_tokens=32, heldout_every=2)
    engine, learner = learning_engine(copy_dir, settings)
    learner.guard = KeepAll()
    drafter, seen = engine.draft.drafter, []
    extend, propose = drafter.extend, drafter.propose

    def weights() -> tuple[int, float]:
        return learner.info.version, float(drafter.net.lm_head.weight.sum())

    def extend_then_note(inputs):
        extend(inputs)
        seen.append(["extend", weights()])

    def propose_then_note(*args, **kwargs):
        trees = propose(*args, **kwargs)
        seen[-1] += ["propose", weights()] if seen and seen[-1][0] == "extend" else []
        return trees

    drafter.extend, drafter.propose = extend_then_note, propose_then_note
    learner.start()
    try:
        for seed in range(6):
            engine.generate(prompts(6, seed=seed), SamplingParams(max_new_tokens=32))
            assert learner.drain(120)
    finally:
        learner.close()
    steps = [s for s in seen if len(s) == 4]
    assert learner.stats().num_swaps >= 2 and len({s[1][0] for s in steps}) >= 3
    assert all(s[1] == s[3] for s in steps)  # extend and propose of a step: the same weights


@pytest.mark.parametrize("kind", ["ngram", "standalone"])
def test_kinds_without_a_trainable_head_refuse_the_switch(copy_dir: Path, kind: str) -> None:
    model = None if kind == "ngram" else str(copy_dir / kind)
    cfg = DraftConfig(kind, model, str(copy_dir / "target"), SpecParams(3, 4, 8),
                      num_kv_slots=1024, online_learning=True)  # fmt: skip
    with pytest.raises(
        ValueError, match=f"--online-learning needs --kind eagle3 or eagle, not {kind}: "
    ):
        load_draft(cfg)


def test_a_draft_without_the_switch_holds_no_learner(copy_dir: Path) -> None:
    assert load_draft(_config(copy_dir)).learner is None
    on = load_draft(_config(copy_dir, online_learning=True))
    assert on.learner is not None and on.learner.thread.is_alive()
    on.learner.close()
    assert not on.learner.thread.is_alive()


def test_metrics_name_updates_rollbacks_and_the_served_version(copy_dir: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    engine, learner = learning_engine(copy_dir, replace(SETTINGS, lr=1.0))
    engine.generate(prompts(9, seed=3), SamplingParams(max_new_tokens=24))
    learner.update()  # rolled back: the lr wrecks the head
    servicer = type("Servicer", (), {"runtime": engine.draft})()
    registry = CollectorRegistry()
    registry.register(OnlineCollector(servicer))
    text = generate_latest(registry).decode()
    assert 'specmesh_online_rollbacks_total{service="draft"} 1.0' in text
    assert 'specmesh_online_weight_version{service="draft"} 0.0' in text
    assert 'specmesh_online_heldout_accept_length{service="draft",weights="before"}' in text
    servicer.runtime = None  # while the service loads: no series
    assert "specmesh_online" not in generate_latest(registry).decode()
