"""The sampling contract (DESIGN.md §6): a seed fixes the output. Each output position's token
is a keyed draw (seed, position) from the processed distribution there, and a tree is verified
by accepting a child exactly when it is that draw, so speculation, the draft, the batch and the
process layout cannot change a seeded output."""

from __future__ import annotations

from pathlib import Path

import torch
from oracle_draft import oracle_engine

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterConfig
from specmesh.router.engine import Engine
from specmesh.runtime.sampling import keyed_uniforms

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=seed,
                          ignore_eos=True)  # fmt: skip


def test_keyed_uniforms_depend_on_the_key_alone() -> None:
    u = keyed_uniforms([7, 7, 7, 8], [0, 1, 0, 0])
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert u[0] == u[2] and u[0] != u[1] and u[0] != u[3]
    many = keyed_uniforms([3] * 20000, range(20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_a_seed_fixes_the_output_whatever_speculates(tiny_dir: Path) -> None:
    """Plain decoding, a random EAGLE-3 head, the oracle draft (its greedy proposals match many
    sampled draws) and batch mates that change the batch's composition: one text per seed."""
    target = tiny_dir / "target"
    plain = Engine(target).generate(PROMPTS, [_params(s) for s in (1, 2, 3)])
    eagle3 = Engine(target, draft_model=tiny_dir / "draft", draft_kind="eagle3",
                    spec=SpecParams(3, 4, 8))  # fmt: skip
    oracle = oracle_engine(target, router_config=RouterConfig(max_batch_size=2))
    for engine in (eagle3, oracle):
        out = engine.generate(PROMPTS, [_params(s) for s in (1, 2, 3)])
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    alone = oracle_engine(target).generate([PROMPTS[1]], [_params(2)])[0]
    assert alone.token_ids == plain[1].token_ids
    accepted = sum(sum(r.accept_lens) - len(r.accept_lens) for r in out)
    assert accepted > 0, "the oracle's trees were never accepted: the test proves nothing"
    other_seed = Engine(target).generate([PROMPTS[0]], [_params(4)])[0]
    assert other_seed.token_ids != plain[0].token_ids
