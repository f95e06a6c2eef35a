"""The rows online learning keeps are bounded: training rows under `train_tokens` (oldest
requests first, an open one too), held-out requests cut and counted, nothing left of a request
once it ends, short requests (the service's warm-up) dropped, and windows cut from the rows as
they arrived, knowing where the prompt (the first extend) ends."""

from __future__ import annotations

import torch

from specmesh.draft_service.online.buffer import TrafficBuffer, cut
from specmesh.draft_service.online.settings import OnlineSettings

WIDTH = 6


def _rows(n: int, first: int = 0) -> tuple[list[int], torch.Tensor]:
    ids = list(range(first, first + n))
    return ids, torch.tensor(ids, dtype=torch.float32)[:, None].expand(n, WIDTH).contiguous()


def _buffer(**overrides) -> TrafficBuffer:
    settings = OnlineSettings(**{"train_tokens": 100, "heldout_every": 4, "heldout_sequences": 4,
                                 "heldout_sequence_tokens": 10, **overrides})  # fmt: skip
    return TrafficBuffer(settings, torch.bfloat16)


def test_training_rows_stay_under_the_bound_oldest_request_first() -> None:
    buf = _buffer(heldout_every=1000)
    for r in range(12):
        buf.add(f"r{r}", True, *_rows(30, 100 * r))
        assert buf.sizes()[0] <= 100
    assert [rows.key for rows in buf.train.values()] == [10, 11, 12]  # the newest three
    assert buf.num_seen_tokens == 12 * 30


def test_an_open_request_evicted_starts_again_with_its_next_rows() -> None:
    buf = _buffer(heldout_every=1000)
    buf.add("long", True, *_rows(60))
    buf.add("other", True, *_rows(60, 1000))  # 120 rows: the long one goes
    assert "long" not in buf.open
    buf.add("long", False, *_rows(5, 60))  # continues: a new entry from its next rows on
    assert buf.open["long"].num_tokens == 5


def test_held_out_requests_are_cut_counted_and_never_trained_on() -> None:
    buf = _buffer()
    for r in range(16):
        buf.add(f"r{r}", True, *_rows(30, 100 * r))
    _, heldout = buf.sizes()
    assert len(buf.recent) == 2 and len(buf.reservoir) == 2  # 4 held out in all, 2 + 2
    assert heldout == 4 * 10  # each cut at heldout_sequence_tokens
    held = {int(w.tokens[0]) for w in buf.heldout()}
    assert all(int(w.tokens[0]) not in held for w in buf.windows(50, 8))


def test_nothing_is_held_of_a_request_after_it_ends() -> None:
    buf = _buffer(heldout_every=1000)
    buf.add("a", True, *_rows(20))
    buf.add("b", True, *_rows(2))  # the draft service's warm-up: two rows
    buf.close("a")
    buf.close("b")
    assert buf.open == {}
    assert [rows.num_tokens for rows in buf.train.values()] == [20]  # the short one dropped
    buf.close("never-seen")  # a request that failed before any rows: nothing to do


def test_rows_are_copied_in_the_buffers_dtype() -> None:
    buf = _buffer(heldout_every=1000)
    ids, feats = _rows(10)
    buf.add("a", True, ids, feats)
    feats.zero_()  # the batch tensor the extend came in is reused: the rows kept are not
    kept = buf.windows(1, 10)[0].features
    assert kept.dtype == torch.bfloat16 and kept[:, 0].tolist() == list(range(10))


def test_windows_join_the_chunks_of_several_extends() -> None:
    buf = _buffer(heldout_every=1000)
    buf.add("a", True, *_rows(4))
    for start in range(4, 20, 3):
        buf.add("a", False, *_rows(3, start))
    chunks = buf.open["a"].chunks()
    w = cut((chunks, 5, 9, 4))
    assert w.tokens.tolist() == list(range(5, 14)) and w.features[:, 0].tolist() == list(
        range(5, 14)
    )
    assert w.first_output == 0  # rows 0 .. 3 were the prompt (the first extend's): all before
    assert cut((chunks, 1, 9, 4)).first_output == 3
    for w in buf.windows(20, 6):
        first = int(w.tokens[0])
        assert w.tokens.tolist() == list(range(first, first + 6))
        assert w.first_output == max(4 - first, 0)
