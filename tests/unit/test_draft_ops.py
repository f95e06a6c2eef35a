"""The host work of a draft round, in operators dispatched outside its captured forwards
(`bench/draft_ops.py`): on a GPU each is a few microseconds of a round that is host-bound
(bench_results/gpu/round3), so the count may only go down. Counts are deterministic."""

from __future__ import annotations

from pathlib import Path

from specmesh.bench.draft_ops import count_round_ops, split_reads

# 550 at batch 1 before a full bucket skipped its padding ops, 448 / 1030 before the search's
# steps were laid out once (`step_batch`) and the trees selected on the device (`select_tree`),
# 350 / 682 before the search ran as one graph (`search_graph`: its body is not counted), 149 /
# 299 before its layout's indices, then 118 / 255 before the ragged metadata's
# (`build_metadata`), were computed in numpy and copied at once (with its ids and positions
# since, and numpy()'s no-op dispatches not counted), then 110 / 220 before a KV reservation
# copied its slots and their places to the device at once, 109 / 218 before the extend's graph
# runner wrote its ids, positions and indptrs from the host in one copy, 103 / 204 before the
# search stacked its roots' logits and hidden straight into its inputs, 101 / 202 before a
# batch's token ids were joined in one op, 101 / 199 before the search's prefix columns were
# laid out in numpy for the batch (not three operators a request) and the extend padded its
# ids in numpy and kept its rows as one unbind's views; lower these as the round gets shorter,
# never raise them for a feature.
MAX_OPS = {1: 94, 3: 174}


def test_a_draft_round_dispatches_at_most_its_budget(tmp_path: Path) -> None:
    for batch, budget in MAX_OPS.items():
        counts, _ = split_reads(count_round_ops(tmp_path / "models", batch, rounds=2))
        total = sum(counts.values())
        assert 0 < total <= budget, (batch, total, counts.most_common(10))
        stages = {stage for stage, _ in counts}
        assert {"extend", "propose"} <= stages and "expand" not in stages  # in the graph


def test_a_search_reads_the_host_only_for_its_trees(tmp_path: Path) -> None:
    """No step of a search reads a value back (on a GPU each read is a copy and a sync that
    stops the host from running ahead, and inside the search's graph a failed capture): the
    finished trees are its one read. The torch reference
    backend's own reads show at batches that pad."""
    _, reads = split_reads(count_round_ops(tmp_path / "models", 1, rounds=2))
    assert reads.get("expand", 0) == 0
    assert reads["propose"] == 1
