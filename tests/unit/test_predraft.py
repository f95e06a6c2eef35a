"""Pre-drafting (`specmesh.draft_service.predraft`): trees drafted ahead for a verify's likely
outcomes are used when the outcome comes, output stays exact (greedy against transformers, seeded
sampling against plain decoding) and nothing outlives its request."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_speculated

from specmesh.defaults import REPO_MODELS
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.router.tokenizer import load_tokenizer
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.tiny_drafts import make_tiny_draft

TARGET, DRAFT = REPO_MODELS / "target", REPO_MODELS / "draft"
CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
FP32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(TARGET)
    return [tokenizer.encode(text) for text in CODE]


def demo_engine(predraft: int) -> Engine:
    return Engine(
        TARGET, draft_model=DRAFT, draft_kind="eagle3", spec=SpecParams(5, 4, 8),
        target_config=FP32, draft_config={**FP32, "predraft": predraft},
    )  # fmt: skip


def test_move_entries_permutes_a_row() -> None:
    cache = KVCache(num_layers=1, num_slots=32, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    max_requests=2, max_context=32)  # fmt: skip
    cache.add("r")
    cache.reserve("r", 20)
    before = cache.slots("r", 0, 20).tolist()
    cache.move_entries("r", 12, 5, 6)  # overlapping: [12, 18) -> [5, 11)
    after = cache.slots("r", 0, 20).tolist()
    assert after[5:11] == before[12:18]
    assert after[:5] == before[:5] and after[18:] == before[18:]
    assert sorted(after) == sorted(before)  # still each slot once


def test_predrafted_trees_keep_greedy_output_exact(prompts, oracle) -> None:
    """The demo pair with 4 outcomes drafted ahead: rounds hit and miss, every output equals
    transformers, and the draft holds nothing afterwards (pre-drafted state included)."""
    engine = demo_engine(predraft=4)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    results = engine.generate(prompts, params)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == oracle(TARGET, prompt, 48)
    assert_speculated(results, min_mean_accept=2.0)
    hits = sum(r.num_predraft_hits for r in results)
    rounds = sum(len(r.accept_lens) for r in results)
    assert 0 < hits < rounds, f"{hits} pre-drafted trees in {rounds} rounds: hits and misses both"
    draft = engine.draft
    assert not draft.live and not draft.drafter.cache.requests
    assert not draft.ahead.trees and not draft.ahead.outcomes
    assert draft.kv_slots()[0] == 0  # prefix-cache slots no request lists count as free


def test_a_seed_fixes_the_output_with_predrafts(prompts) -> None:
    """Seeded sampling (DESIGN.md §6): each position's token is a keyed draw, so trees drafted
    ahead change nothing: the output equals plain decoding's, seed for seed (the distribution
    is then exactly the target's)."""
    params = [SamplingParams(max_new_tokens=32, temperature=0.8, seed=s, ignore_eos=True)
              for s in range(len(prompts))]  # fmt: skip
    plain = Engine(TARGET, target_config=FP32).generate(prompts, params)
    ahead = demo_engine(predraft=4).generate(prompts, params)
    assert [r.token_ids for r in ahead] == [r.token_ids for r in plain]
    assert sum(r.num_predraft_hits for r in ahead) > 0


def test_predraft_is_off_for_mtp_and_by_default(tiny_dir, tmp_path) -> None:
    """Off unless asked; and an MTP draft has no layer for an outcome's deeper steps."""
    assert demo_engine(predraft=0).draft.ahead is None
    target = tiny_dir / "target"
    mtp = make_tiny_draft(tmp_path / "mtp", str(target), "mtp")
    engine = Engine(target, draft_model=mtp, draft_kind="mtp", spec=SpecParams(3, 2, 5),
                    draft_config={"predraft": 4})  # fmt: skip
    assert engine.draft.ahead is None


def test_a_hit_moves_its_tree_into_place(prompts, monkeypatch) -> None:
    """After a hit the outcome's subtree is re-indexed where a search would have put it: every
    forwarded node's record points at the same KV slot (the K/V it was grown with) under its new
    token index, and the moved entries sit past the exact prefix the extend rewrote."""
    from specmesh.draft_service.predraft import PreDrafter

    checked = []
    adopt = PreDrafter.adopt

    def checked_adopt(self, rid, outcome):
        cache = self.drafter.cache
        before = {path: int(cache.slots(rid, r.kv, r.kv + 1)) for path, r in outcome.records.items()
                  if r.kv is not None}  # fmt: skip
        adopt(self, rid, outcome)
        _, records = self.trees[rid]
        spec_base = self.drafter.roots[rid].spec_base
        for path, slot in before.items():
            kv = records[path].kv
            assert kv >= spec_base and int(cache.slots(rid, kv, kv + 1)) == slot
        checked.append(len(before))

    monkeypatch.setattr(PreDrafter, "adopt", checked_adopt)
    demo_engine(predraft=4).generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert checked and all(n > 0 for n in checked)


# -- the pre-drafted state itself -----------------------------------------------------------------
# The target verifies every tree, so output cannot show a pre-drafted tree that is wrong for its
# outcome (only acceptance suffers): these tests compare the state. A standalone draft needs no
# target features, so the tree it pre-drafts for an outcome is exactly the tree it drafts from
# scratch once that outcome is committed (same rows, same positions, same search).
COLD_PROMPT = [17, 42, 99, 5, 6, 7, 8]
SPEC = SpecParams(3, 2, 6)


def _standalone(copy_dir, predraft: int):
    from specmesh.draft_service.runtime import load_draft
    from specmesh.protocol.config import DraftConfig

    cfg = DraftConfig("standalone", str(copy_dir / "standalone"), str(copy_dir / "target"), SPEC,
                      predraft=predraft, predraft_steps=SPEC.num_steps, prefix_cache_tokens=0)  # fmt: skip
    return load_draft(cfg)


def _tree(result, rid: str) -> tuple[list[int], list[int]]:
    tree = result.trees[rid]
    return list(tree.tokens), list(tree.parents)


def _cold_tree(cold, ids: tuple[int, ...], bonus: int) -> tuple[list[int], list[int]]:
    """The tree a draft without any state proposes once ``ids`` are committed after the prompt
    and ``bonus`` is pending."""
    from specmesh.protocol.steps import ExtendInput

    rid = f"cold-{len(cold.live)}"
    result = cold.step([ExtendInput(rid, [*COLD_PROMPT, *ids], bonus, new=True)])
    return _tree(result, rid)


def _predrafted(ahead, rid: str) -> dict:
    """Start ``rid`` on the prompt and pre-draft its answered tree's outcomes."""
    from specmesh.protocol.steps import ExtendInput

    ahead.step([ExtendInput(rid, COLD_PROMPT, 77, new=True)])
    ahead.after_step()
    outcomes = ahead.ahead.outcomes[rid]
    assert len(outcomes) > 1
    return dict(outcomes)


def test_a_predrafted_tree_is_the_tree_drafted_cold(copy_dir) -> None:
    """Every outcome's tree equals the tree the same draft proposes for that outcome from
    scratch; an extend that commits the outcome gets that tree as a hit."""
    from specmesh.protocol.steps import ExtendInput

    ahead, cold = _standalone(copy_dir, predraft=4), _standalone(copy_dir, predraft=0)
    outcomes = _predrafted(ahead, "r")
    for (ids, bonus), outcome in outcomes.items():
        drafted = (list(outcome.tree.tokens), list(outcome.tree.parents))
        assert drafted == _cold_tree(cold, ids, bonus), (ids, bonus)
    (ids, bonus), outcome = max(outcomes.items(), key=lambda kv: len(kv[0][0]))
    result = ahead.step([ExtendInput("r", list(ids), bonus)])
    assert "r" in result.predrafted
    assert _tree(result, "r") == _cold_tree(cold, ids, bonus)


def test_an_outcome_is_matched_on_its_path_not_its_bonus_alone(copy_dir) -> None:
    """An extend whose bonus token is an outcome's but whose accepted path is another misses:
    the outcome's tree was grown below a path the target did not accept."""
    from specmesh.protocol.steps import ExtendInput

    ahead, cold = _standalone(copy_dir, predraft=4), _standalone(copy_dir, predraft=0)
    outcomes = _predrafted(ahead, "r")
    (ids, bonus) = next(k for k in outcomes if len(k[0]) > 1)
    other = ids[:-1]  # the path one token short, the same bonus
    assert (other, bonus) not in outcomes
    result = ahead.step([ExtendInput("r", list(other), bonus)])
    assert "r" not in result.predrafted, "a pre-drafted tree was taken for another path"
    assert _tree(result, "r") == _cold_tree(cold, other, bonus)
