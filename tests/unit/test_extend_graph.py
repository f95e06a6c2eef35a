"""The draft extend after a verify through its static-shape runner (eager-static on CPU, the path a
GPU captures): each request's accepted rows are padded with filler rows to ``num_steps + 1``, and
the drafter ends in the same state as the eager extend (root hidden and logits, committed KV,
next proposal); prefill extends and requests near their context limit run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.tiny import make_tiny_target
from specmesh.runtime.tiny_drafts import make_tiny_draft

PROMPTS = {"a": 6, "b": 3, "c": 9}
ACCEPTED = {"a": 1, "b": 4, "c": 2}  # 1 .. num_steps + 1 committed tokens after a verify
SPEC = SpecParams(num_steps=3, topk=2, num_draft_tokens=5)


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def pair(request, tmp_path_factory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    target = make_tiny_target(root / "target", seed=0)
    return request.param, target, make_tiny_draft(root / "draft", target, request.param, seed=3)


def _drafter(pair, max_context: int = 64):
    kind, target, draft = pair
    cfg = DraftConfig(kind, str(draft), str(target), SPEC, dtype="fp32", num_kv_slots=512,
                      max_requests=8, max_context=max_context)  # fmt: skip
    return load_draft(cfg).drafter


def _run(drafter):
    """Prefill three requests, then one post-verify extend of different widths."""
    width = drafter.net.feature_width
    g = torch.Generator().manual_seed(0)
    feats = lambda n: torch.randn(n, width, generator=g)
    drafter.extend([ExtendInput(r, list(range(4, 4 + n)), 20, feats(n), new=True)
                    for r, n in PROMPTS.items()])  # fmt: skip
    drafter.extend([ExtendInput(r, [20, *range(30, 29 + n)], 40 + n, feats(n))
                    for r, n in ACCEPTED.items()])  # fmt: skip
    return drafter


def test_extend_graph_leaves_the_eager_state(pair) -> None:
    want = _run(_drafter(pair))
    got = _drafter(pair)
    got.enable_step_graphs("eager-static", max_bs=4)
    calls = []
    run = got.extend_graph.runner.run
    got.extend_graph.runner.run = lambda items, h: (
        calls.append([i.q_len for i in items]) or run(items, h)
    )
    _run(got)
    assert calls == [[SPEC.num_steps + 1] * 3]  # the post-verify extend only, padded
    for rid in PROMPTS:
        a, b = got.roots[rid], want.roots[rid]
        assert (a.last_pos, a.spec_base) == (b.last_pos, b.spec_base)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        n = got.cache.get(rid).committed_len
        assert n == want.cache.get(rid).committed_len == PROMPTS[rid] + ACCEPTED[rid]
        for pg, pw in zip(got.cache.pools, want.cache.pools, strict=True):
            torch.testing.assert_close(pg.k[got.cache.slots(rid, 0, n)],
                                       pw.k[want.cache.slots(rid, 0, n)], atol=1e-5, rtol=1e-5)  # fmt: skip
    roots = [50, 51, 52]
    for a, b in zip(
        got.propose(list(PROMPTS), roots), want.propose(list(PROMPTS), roots), strict=True
    ):
        assert a == b  # tokens and parents


def test_extend_near_the_context_limit_runs_eagerly(pair) -> None:
    drafter = _drafter(pair, max_context=PROMPTS["c"] + 3)  # c's padded rows would not fit
    drafter.enable_step_graphs("eager-static", max_bs=4)
    calls = []
    run = drafter.extend_graph.runner.run
    drafter.extend_graph.runner.run = lambda *a: calls.append(1) or run(*a)
    _run(drafter)
    assert not calls and drafter.cache.get("c").committed_len == PROMPTS["c"] + ACCEPTED["c"]
