"""Verification that bites: the sibling-last oracle (`oracle_draft`) makes verify accept 0..3
draft tokens per round along a path that is never a prefix of tree order, on a target whose
greedy output does not repeat. Keeping the wrong KV, dropping the bonus token or a tree mask
without ancestors changes these outputs; see `scripts/mutants.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle_draft import assert_varied, mean_accept, oracle_engine

from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.router_config import RouterConfig

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90], [7, 7]]
MAX_NEW = [20, 11, 16, 24, 13]
# The oracle's rounds accept 3, 2, 1, 0 draft tokens in turn: 2.5 tokens per round, bonus
# included, less what the last round of each request cuts off.
MIN_MEAN_ACCEPT = 2.2


def test_fixture_target_does_not_degenerate(tiny_dir: Path, oracle) -> None:
    for prompt in PROMPTS:
        assert_varied(oracle(tiny_dir / "target", prompt, 24))


@pytest.mark.parametrize("backend", ["torch", cpu_triton()])
def test_out_of_order_acceptance_equals_transformers(tiny_dir: Path, oracle, backend: str) -> None:
    """Two micro-batches of two requests, joining as others finish; every round's accepted path
    skips the first sibling at every depth."""
    engine = oracle_engine(
        tiny_dir / "target", target_config={"attention_backend": backend},
        router_config=RouterConfig(max_batch_size=2, num_micro_batches=2),
    )  # fmt: skip
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    results = engine.generate(PROMPTS, params)
    for prompt, n, res in zip(PROMPTS, MAX_NEW, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, n)
    assert max(n for r in results for n in r.accept_lens) == 4
    assert mean_accept(results) >= MIN_MEAN_ACCEPT, [r.accept_lens for r in results]
    assert engine.target.backend.name == backend


def test_out_of_order_acceptance_through_static_runners(tiny_dir: Path, oracle) -> None:
    """Verify through the eager-static runner (the CUDA-graph wiring, padded to the tree size)."""
    from specmesh.target_service.runtime import TargetGraphs

    engine = oracle_engine(tiny_dir / "target")
    t = engine.target
    t.configure(engine.draft.info().needs)  # the handshake first: it names the aux layers
    t.graphs = TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=4,
                            tree_sizes=t.cfg.cuda_graph_tree_sizes, aux=t.aux_layers)  # fmt: skip
    verify, used = t.graphs.verify[t.cfg.cuda_graph_tree_sizes[0]], []
    run = verify.run
    verify.run = lambda *a, **k: used.append(1) or run(*a, **k)
    results = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, res in zip(PROMPTS[:3], results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 16)
    assert used and mean_accept(results) >= MIN_MEAN_ACCEPT


def test_sampled_rounds_accept_out_of_order_and_replay_exactly(tiny_dir: Path) -> None:
    """Seeded sampling: the same seed gives the same output twice, and a low temperature (the
    oracle's greedy path carries nearly all the mass) accepts drafts along the same paths."""
    params = SamplingParams(max_new_tokens=16, temperature=0.05, seed=3, ignore_eos=True)
    runs = [oracle_engine(tiny_dir / "target").generate(PROMPTS[:2], params) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert mean_accept(runs[0]) >= 2.0
