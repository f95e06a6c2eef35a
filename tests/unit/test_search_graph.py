"""The draft's whole search as one graph per batch bucket (`draft_service/search_graph.py`), run
eagerly over its static buffers on CPU: its trees equal the ragged search's at every bucket,
full or padded, and a padded bucket's padding writes nothing a real request reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams


@pytest.mark.parametrize(("steps", "topk", "tokens"), [(2, 1, 2), (2, 3, 4), (4, 2, 8)])
def test_search_graph_equals_the_ragged_search_at_every_bucket(
    tiny_dir: Path, steps: int, topk: int, tokens: int
) -> None:
    """EAGLE-3 trees of several shapes (one node a step, a shallow wide tree, a deep one) from
    the search graph equal the ragged search's for 1 .. 5 requests over buckets {1, 2, 4}: full
    buckets, padded ones, and 5, past the largest, which searches step by step instead."""
    from specmesh.protocol.steps import ExtendInput

    spec = SpecParams(num_steps=steps, topk=topk, num_draft_tokens=tokens)
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), spec,
                      dtype="fp32", num_kv_slots=1024, max_requests=8, max_context=64)  # fmt: skip
    drafter = load_draft(cfg).drafter
    feat_dim = 3 * drafter.net.config.base.hidden_size
    g = torch.Generator().manual_seed(steps * 10 + topk)
    rids = [f"r{i}" for i in range(5)]
    drafter.extend([
        ExtendInput(rid, list(range(4, 6 + i)), 30 + i, torch.randn(2 + i, feat_dim, generator=g), new=True)
        for i, rid in enumerate(rids)
    ])  # fmt: skip
    roots = [30 + i for i in range(5)]
    want = drafter.propose(rids, roots)  # ragged: no static runners yet
    drafter.enable_step_graphs("eager-static", max_bs=4)
    buckets: list[int] = []
    replay = drafter.search_graphs.replay
    drafter.search_graphs.replay = lambda bucket: buckets.append(bucket) or replay(bucket)
    for n in range(1, 6):
        assert drafter.propose(rids[:n], roots[:n]) == want[:n], n
    assert buckets == [1, 2, 4, 4]  # 5 requests: past the largest bucket, step by step
    for rid in rids:
        drafter.release(rid)
    assert drafter.cache.num_used_slots == 0


def test_a_padded_search_writes_nothing_where_a_released_request_was(tiny_dir: Path) -> None:
    """Four requests fill the search graph's largest bucket; one is released and a new, longer
    request takes its KV slots (the pool hands freed slots out first). A search that pads the
    bucket at the released one's place must write its padding's KV to the scratch slot, not to
    the slots the released request's nodes used (now the new request's committed KV), and its
    padding's mask columns into the padding's own rows, not where the layout put the released
    request's (now inside the new request's rows): every tree equals the ragged search's, the
    KV stays as it was, and each step's mask equals a fresh drafter's, which never held the
    released request."""
    from specmesh.protocol.steps import ExtendInput

    spec = SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), spec,
                      dtype="fp32", num_kv_slots=256, max_requests=8, max_context=64)  # fmt: skip
    ragged, drafter, fresh = (load_draft(cfg).drafter for _ in range(3))
    for d in (drafter, fresh):
        d.enable_step_graphs("eager-static", max_bs=4)
    feat_dim = 3 * drafter.net.config.base.hidden_size
    g = torch.Generator().manual_seed(7)
    lens = {"a": 3, "b": 3, "c": 3, "x": 3, "d": 17}  # d's node 0 columns where x's were
    features = {rid: torch.randn(n, feat_dim, generator=g) for rid, n in lens.items()}

    def starts(rids: str) -> list[ExtendInput]:
        return [ExtendInput(rid, list(range(4, 4 + lens[rid])), 40, features[rid], new=True)
                for rid in rids]  # fmt: skip

    def both(op: str, *args):
        want, got = (getattr(d, op)(*args) for d in (ragged, drafter))
        assert got == want, (op, args)

    both("extend", starts("abcx"))
    both("propose", list("abcx"), [40] * 4)  # bucket 4, full: x's nodes last
    x_slots = set(drafter.cache.get("x").pages)
    both("release", "x")
    both("extend", starts("d"))
    fresh.extend(starts("abd"))
    cache, d = drafter.cache, drafter.cache.get("d")
    committed = cache.slots("d", 0, d.committed_len)
    assert x_slots <= set(committed.tolist())  # the test's premise: d holds x's old slots
    before = [(pool.k[committed].clone(), pool.v[committed].clone()) for pool in cache.pools]
    both("propose", list("abd"), [40] * 3)  # bucket 4: padding where x was
    fresh.propose(list("abd"), [40] * 3)
    for step, runner in drafter.search_graphs.runners.items():  # the last step's mask
        real = sum(lens[r] + spec.topk * (spec.num_steps - 1) for r in "abd") * spec.topk
        theirs = fresh.search_graphs.runners[step].buffers.custom_mask[:real]
        assert torch.equal(runner.buffers.custom_mask[:real], theirs), step
    for (k, v), pool in zip(before, cache.pools, strict=True):
        assert torch.equal(pool.k[committed], k) and torch.equal(pool.v[committed], v)
    both("propose", ["d"], [40])
    for rid in "abcd":
        both("release", rid)
    assert cache.num_used_slots == len(cache.shared)  # d's full blocks, in the prefix cache
