"""The sampling contract (DESIGN.md §6): a seed fixes the output. Each output position's token
is a keyed draw (Gumbel-max, noise keyed by seed, position and token) from the processed
distribution there, and a tree is verified by accepting a child exactly when it is that draw, so
speculation, the draft, the batch and the process layout cannot change a seeded output. The
draws follow the processed distribution (chi-square over fixed seeds, so nothing flakes)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from oracle_draft import oracle_engine

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig
from specmesh.runtime.sampling import draw_tokens, processed_probs

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]
# Issue 54's shape: a 450-token prompt at temperature 0.9, seed 708 (a long prefix makes the
# verify and plain-decode logits differ by rounding).
LONG = [(37 * i + 11) % 300 + 4 for i in range(450)]
LONG_PARAMS = SamplingParams(max_new_tokens=24, temperature=0.9, seed=708, ignore_eos=True)


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=seed,
                          ignore_eos=True)  # fmt: skip


def _chi2_critical(dof: int) -> float:
    """The 0.999 quantile of chi-square with ``dof`` degrees (Wilson-Hilferty, z = 3.09)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3


def _chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells expecting >= 5 (the others pooled into one cell)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = (obs, exp) if exp[-1] >= 5 else (obs[:-1], exp[:-1])
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def test_a_draw_depends_on_its_key_alone() -> None:
    """The same (seed, position) draws the same token whatever shares the batch; another
    position or seed draws independently."""
    logits = torch.randn(1, 320, generator=torch.Generator().manual_seed(0)).repeat(4, 1)
    params = [_params(s) for s in (7, 7, 8, 7)]
    alone = draw_tokens(logits[:1], params[:1], [3])
    batch = draw_tokens(logits, params, [5, 3, 3, 3])
    assert batch[1] == alone and batch[3] == alone
    assert (
        len(set(draw_tokens(logits[:1].repeat(64, 1), [_params(7)] * 64, range(64)).tolist())) > 20
    )


def test_draws_over_seeds_follow_the_processed_distribution() -> None:
    """24,000 draws (6,000 seeds x 4 positions) of one row under temperature, top-k, top-p and
    min_p: tokens the processors removed never come, the rest match `processed_probs` (chi-square
    at 0.001; the seeds are fixed, so the test cannot flake)."""
    logits = torch.tensor([[2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -6.0]])
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.97, min_p=0.01, seed=0)
    probs = processed_probs(logits, [params])[0]
    assert 8 <= int((probs > 0).sum()) < 12
    seeds, positions = [s for s in range(6000) for _ in range(4)], list(range(4)) * 6000
    rows = [
        SamplingParams(temperature=0.8, top_k=10, top_p=0.97, min_p=0.01, seed=s) for s in seeds
    ]
    drawn = draw_tokens(logits.expand(len(rows), -1), rows, positions)
    counts = torch.bincount(drawn, minlength=12).double()
    assert counts[probs == 0].sum() == 0
    stat, dof = _chi_square(counts, probs.double() * len(rows))
    assert stat < _chi2_critical(dof), (stat, dof, counts.tolist())


def test_neighbouring_positions_draw_independently() -> None:
    """The draws at positions p and p + 1 of one seed (10,000 seeds) are independent: their
    joint counts match the product distribution (chi-square at 0.001)."""
    logits = torch.tensor([[0.9, 0.3, 0.0, -0.4]])
    n = 10_000
    params = [_params(s) for s in range(n) for _ in range(2)]
    positions = [p for s in range(n) for p in (s % 50, s % 50 + 1)]
    drawn = draw_tokens(logits.expand(2 * n, -1), params, positions).view(n, 2)
    joint = torch.bincount(drawn[:, 0] * 4 + drawn[:, 1], minlength=16).double()
    probs = processed_probs(logits, [params[0]])[0].double()
    stat, dof = _chi_square(joint, torch.outer(probs, probs).flatten() * n)
    assert stat < _chi2_critical(dof), (stat, dof)


def test_a_seed_fixes_the_output_whatever_speculates(tiny_dir: Path) -> None:
    """Plain decoding, a random EAGLE-3 head, the oracle draft (its greedy proposals match many
    sampled draws) and batch mates that change the batch's composition: one text per seed,
    the long prompt's included."""
    target = tiny_dir / "target"
    prompts, params = [*PROMPTS, LONG], [*(_params(s) for s in (1, 2, 3)), LONG_PARAMS]
    plain = Engine(target).generate(prompts, params)
    eagle3 = Engine(target, draft_model=tiny_dir / "draft", draft_kind="eagle3",
                    spec=SpecParams(3, 4, 8))  # fmt: skip
    oracle = oracle_engine(target, router_config=RouterConfig(max_batch_size=2))
    for engine in (eagle3, oracle):
        out = engine.generate(prompts, params)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    alone = oracle_engine(target).generate([PROMPTS[1]], [_params(2)])[0]
    assert alone.token_ids == plain[1].token_ids
    accepted = sum(sum(r.accept_lens) - len(r.accept_lens) for r in out)
    assert accepted > 0, "the oracle's trees were never accepted: the test proves nothing"
    other_seed = Engine(target).generate([PROMPTS[0]], [_params(4)])[0]
    assert other_seed.token_ids != plain[0].token_ids
