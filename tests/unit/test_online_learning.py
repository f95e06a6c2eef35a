"""Online learning on the copy pair (an EAGLE-3 draft whose tokens the target accepts): output
is the target's with a learned version served (greedy equal to transformers, seeded samples
equal to learning off), an update that lowers held-out acceptance is rolled back, and a stream
of random tokens cannot lower acceptance on real held-out traffic by more than the guard's
threshold (while the same stream, unguarded, does)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, hf_greedy
from online_traffic import SETTINGS, KeepAll, learning_engine, prompts

from specmesh.draft_service.online import attach_learner
from specmesh.draft_service.online.head import load_into, trainable_head
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput
from specmesh.router.engine import Engine


def served_differs(learner) -> bool:
    served = dict(learner.net.named_parameters())
    return any(not torch.equal(served[k].float(), v) for k, v in learner.shipped.items())


@pytest.fixture(scope="module")
def learned(copy_dir: Path):
    """An engine whose draft has served traffic and then a learned version (kept by a guard
    that keeps everything), not yet swapped in."""
    engine, learner = learning_engine(copy_dir)
    engine.generate(prompts(9, seed=0), SamplingParams(max_new_tokens=24))
    learner.guard = KeepAll()
    assert learner.update().keep and learner.version == 1
    return engine, learner


def test_greedy_output_with_a_learned_version_equals_transformers(learned, copy_dir) -> None:
    engine, learner = learned
    batch = prompts(4, seed=1)
    results = engine.generate(batch, SamplingParams(max_new_tokens=24))
    assert (
        learner.stats().version == 1 and learner.stats().num_swaps == 1 and served_differs(learner)
    )
    for prompt, r in zip(batch, results, strict=True):
        assert r.token_ids == hf_greedy(copy_dir / "target", prompt, 24)
        assert r.draft_weight_versions == [1]  # every tree drafted with the version served
    assert_accepted(results, 4)


def test_seeded_sampling_is_the_same_text_as_learning_off(learned, copy_dir) -> None:
    engine, learner = learned
    plain = Engine(copy_dir / "target", draft_model=copy_dir / "eagle3", draft_kind="eagle3",
                   spec=SpecParams(3, 4, 8))  # fmt: skip
    batch = prompts(4, seed=2)
    params = [SamplingParams(max_new_tokens=24, temperature=0.8, seed=s) for s in range(4)]
    on, off = engine.generate(batch, params), plain.generate(batch, params)
    assert served_differs(learner)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.text for r in on] == [r.text for r in off]
    assert_accepted(on, 4)
    assert all(r.draft_weight_versions == [] for r in off)  # a draft that does not learn


def test_an_update_that_lowers_held_out_acceptance_is_rolled_back(copy_dir) -> None:
    engine, learner = learning_engine(copy_dir, replace(SETTINGS, lr=1.0))  # wrecks the head
    engine.generate(prompts(9, seed=3), SamplingParams(max_new_tokens=24))
    before = {k: v.clone() for k, v in learner.net.named_parameters()}
    verdict = learner.update()
    assert verdict.served.accepted > 0 and verdict.candidate.accepted < verdict.served.accepted
    assert not verdict.keep and verdict.rewind and not verdict.reset
    stats = learner.stats()
    assert (stats.num_rollbacks, stats.num_updates, stats.version) == (1, 0, 0)
    assert stats.heldout_after < stats.heldout_before
    engine.generate(prompts(2, seed=4), SamplingParams(max_new_tokens=8))  # a step: no swap
    assert all(torch.equal(p, before[k]) for k, p in learner.net.named_parameters())
    trained = dict(learner.head.named_parameters())  # the trainer starts again from the served
    assert all(torch.equal(trained[k], v) for k, v in learner.served.items())


def _noise(runtime, count: int, seed: int, scale: float) -> None:
    """Requests of random tokens with random features, through the draft's own step: a short
    prompt, then extends of random "output" tokens, as a verify's would come."""
    g = torch.Generator().manual_seed(seed)
    width = runtime.drafter.net.feature_width
    for i in range(count):
        rid, new = f"noise-{seed}-{i}", True
        for n in (8, *[4] * 14):
            ids = torch.randint(3, 300, (n + 1,), generator=g).tolist()
            feats = torch.randn(n, width, generator=g) * scale
            extend = ExtendInput(rid, ids[:-1], ids[-1], feats, new=new)
            assert not runtime.step([extend]).errors
            new = False
        runtime.release(rid)


def _random_stream(copy_dir: Path, guarded: bool) -> tuple[int, int, float]:
    """(accepted drafts on real held-out traffic before a random stream, after it, the
    guard's threshold)."""
    settings = replace(SETTINGS, heldout_every=2, heldout_sequences=16, update_tokens=512,
                       steps_per_update=8, lr=3e-3)  # fmt: skip
    engine, learner = learning_engine(copy_dir, settings)
    engine.generate(prompts(12, seed=5), SamplingParams(max_new_tokens=32))
    real = learner.buffer.heldout()
    scale = float(torch.cat([w.features for w in real]).float().std())
    scratch, guard = trainable_head(learner.net), learner.guard
    before = guard.score(scratch, real).accepted
    if not guarded:
        learner.guard = KeepAll()
    for seed in range(4):
        _noise(engine.draft, 8, seed, scale)
        while learner.due():
            learner.update()
    load_into(scratch, learner.served)
    return before, guard.score(scratch, real).accepted, settings.guard_threshold


def test_random_tokens_cannot_lower_held_out_acceptance_past_the_threshold(copy_dir) -> None:
    before, after, threshold = _random_stream(copy_dir, guarded=True)
    assert before > 0 and after >= (1 - threshold) * before


def test_the_same_random_stream_unguarded_lowers_it(copy_dir) -> None:
    """The stream above is harmful: without the guard it costs more than the threshold."""
    before, after, threshold = _random_stream(copy_dir, guarded=False)
    assert after < (1 - threshold) * before


@pytest.mark.parametrize(
    ("candidate", "served", "shipped", "outcome"),
    [
        (100, 90, 100, "keep"),  # better, and above 0.95 x shipped
        (95, 100, 100, "hold"),  # lower: not served, the trainer goes on from it
        (80, 100, 100, "rewind"),  # below the floor: the trainer back to the served weights
        (92, 93, 100, "reset"),  # the served fell below the floor: the shipped come back
        (96, 96, 100, "keep"),  # a tie is kept
    ],
)
def test_the_guards_verdicts(candidate, served, shipped, outcome) -> None:
    from specmesh.draft_service.online.guard import Guard, Score

    guard = Guard(threshold=0.05, depth=4, embed=None, topk=4)
    scores = iter([Score(candidate, 10), Score(served, 10), Score(shipped, 10)])
    guard.score = lambda head, heldout: next(scores)
    v = guard.judge(None, type("Head", (), {"named_parameters": lambda self: []})(), {}, {}, [])
    got = "keep" if v.keep else "reset" if v.reset else "rewind" if v.rewind else "hold"
    assert got == outcome


def test_every_tree_names_its_version_pre_drafted_ones_too(copy_dir) -> None:
    """A pre-drafting runtime with a learner: each tree of each step's answer, pre-drafted
    (a hit) or drafted on the spot, carries the version it was drafted with: the weights as
    loaded (0), then the version published between the two runs."""
    engine = Engine(copy_dir / "target", draft_model=copy_dir / "eagle3", draft_kind="eagle3",
                    spec=SpecParams(3, 4, 8), draft_config={"predraft": 4})  # fmt: skip
    learner = attach_learner(engine.draft, SETTINGS, start=False)
    learner.guard = KeepAll()
    answers, step = [], engine.draft.step
    engine.draft.step = lambda *a, **kw: answers.append(step(*a, **kw)) or answers[-1]
    first = engine.generate(prompts(6, seed=3), SamplingParams(max_new_tokens=24))
    assert all(r.draft_weight_versions == [0] for r in first)
    assert learner.update().keep
    results = engine.generate(prompts(2, seed=4), SamplingParams(max_new_tokens=24))
    assert all(r.draft_weight_versions == [1] for r in results)
    assert sum(len(a.predrafted) for a in answers) > 0
    for a in answers:
        assert a.versions.keys() == a.trees.keys()
        assert set(a.versions.values()) <= {0, 1}
