"""The host work of a target verify, in operators dispatched outside its captured forward
(`bench/verify_ops.py`): on a GPU each is a launch or a copy of a few microseconds, so the count
may only go down, and what a request adds to a batch least of all. Counts are deterministic."""

from __future__ import annotations

from pathlib import Path

from specmesh.bench.draft_ops import split_reads
from specmesh.bench.verify_ops import count_verify_ops

# 91 / 280 while the kept paths were permuted one request at a time (a host-to-device copy and
# three ops each) and the acceptance stacked every tree's tensors, 81 / 179 while a reservation
# copied its slots and their places to the device apart, 80 / 178 while the graph runner copied
# the batch's metadata into its buffers field by field, 71 / 169 while trees of the one size
# were gathered into the grid they already were, 70 / 168 while the LM head ran outside the
# target's graphs, 69 / 167 while each request's token ids were read apart; lower these as the verify gets shorter,
# never raise them for a feature.
MAX_OPS = {1: 69, 8: 154}


def test_a_verify_dispatches_at_most_its_budget(tmp_path: Path) -> None:
    for batch, budget in MAX_OPS.items():
        counts, reads = split_reads(count_verify_ops(tmp_path / "models", batch, rounds=2))
        total = sum(counts.values())
        assert 0 < total <= budget, (batch, total, counts.most_common(10))
        assert {stage for stage, _ in counts} == {"rows", "decide", "keep"}
        assert not reads.get("keep") and not reads.get("rows")  # the one read is decide's


def test_a_verify_checks_the_kv_cache_once_per_request(tiny_dir: Path, monkeypatch) -> None:
    """Each row's KV demand is counted once as the batch is admitted (the check summed the
    whole batch so far for every row: 528 counts at batch 32, a millisecond of host time a
    step), once when reserved and once by the forward's own check: 3 per request."""
    from specmesh.protocol.config import TargetConfig
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.protocol.steps import PrefillInput
    from specmesh.runtime.kv_cache import KVCache
    from specmesh.target_service.runtime import TargetRuntime

    rt = TargetRuntime(TargetConfig(model_dir=str(tiny_dir / "target"), num_kv_slots=2048))
    rids = [f"r{i}" for i in range(32)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rt.prefill([PrefillInput(r, [3, 4, 5], params) for r in rids])
    calls = []
    count = KVCache.pages_needed
    monkeypatch.setattr(KVCache, "pages_needed", lambda *a: calls.append(1) or count(*a))
    out = rt.decode(rids)
    assert sorted(out.tokens) == sorted(rids) and not out.errors
    assert len(calls) == 3 * len(rids)
