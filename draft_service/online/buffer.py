"""The traffic online learning keeps: the (feature, token) rows of the requests the draft
extends, bounded in rows, split into training and held-out requests.

Row p of a request is the target's feature at position p and the token at p, as the extends
carry them (committed ids unrotated, one feature row each): the prompt first, then each
verify's committed tokens. A request's pending token is not a row yet; it is the first id of
its next extend.

    train     FIFO of requests, at most `train_tokens` rows; the oldest request goes first
              (an open one too: its next rows start a new entry)
    held out  one request in `heldout_every`, never trained on, each cut at
              `heldout_sequence_tokens` rows: the newest half of `heldout_sequences` in
              `recent`, and what leaves `recent` offered to a uniform `reservoir` (older
              traffic, so a burst of new traffic cannot displace every reference the guard has)

The draft thread adds rows (`add`, `close`) and the trainer thread reads them (`windows`,
`heldout`): both under one lock held only to move references; chunks are never written after
they are added, so they are joined outside it.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from specmesh.draft_service.online.settings import OnlineSettings


@dataclass(frozen=True)
class Window:
    """Consecutive rows of one request."""

    tokens: torch.Tensor  # [n] int64, host
    features: torch.Tensor  # [n, width], the buffer's dtype and device
    first_output: int  # index of the first token the target produced (0: all of them)


@dataclass
class Rows:
    """One request's rows in arrival order, in the chunks its extends brought."""

    key: int  # arrival order, unique
    limit: int | None = None  # rows kept at most (held-out requests); None = all
    # Rows of the request's first extend, its prompt: their tokens are the client's, the later
    # ones the target's (0 for an entry started mid-request)
    first_output: int = 0
    tokens: list[torch.Tensor] = field(default_factory=list)  # chunks [n] int64, on the host
    features: list[torch.Tensor] = field(default_factory=list)  # chunks [n, width], device
    num_tokens: int = 0

    def add(self, ids: list[int], features: torch.Tensor, dtype: torch.dtype) -> int:
        """Append what fits under ``limit``; returns the rows added."""
        room = len(ids) if self.limit is None else min(len(ids), self.limit - self.num_tokens)
        if room <= 0:
            return 0
        self.tokens.append(torch.tensor(ids[:room], dtype=torch.int64))
        # a copy: the extend's tensor belongs to its batch, and is often a view of it
        self.features.append(features[:room].to(dtype=dtype, copy=True))
        self.num_tokens += room
        return room

    def chunks(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk lists as they are now (call under the buffer's lock)."""
        return list(self.tokens), list(self.features)


Span = tuple[tuple[list[torch.Tensor], list[torch.Tensor]], int, int, int]


def cut(span: Span) -> Window:
    """Rows ``[start, start + length)`` of a request's chunks, from ``(chunks, start, length,
    first_output)``."""
    (chunk_ids, chunk_feats), start, length, first_output = span
    tokens, features, offset = [], [], 0
    for ids, feats in zip(chunk_ids, chunk_feats, strict=True):
        lo, hi = max(start - offset, 0), min(start + length - offset, len(ids))
        if lo < hi:
            tokens.append(ids[lo:hi])
            features.append(feats[lo:hi])
        offset += len(ids)
    return Window(torch.cat(tokens), torch.cat(features), max(first_output - start, 0))


class TrafficBuffer:
    def __init__(self, settings: OnlineSettings, dtype: torch.dtype) -> None:
        self.settings, self.dtype = settings, dtype
        self.lock = threading.Lock()
        self.rng = random.Random(settings.seed)
        self.train: OrderedDict[int, Rows] = OrderedDict()
        num_recent = max(1, settings.heldout_sequences // 2)
        self.recent: deque[Rows] = deque()
        self.max_recent, self.max_reservoir = num_recent, settings.heldout_sequences - num_recent
        self.reservoir: list[Rows] = []
        self.num_offered = 0  # requests offered to the reservoir so far
        self.open: dict[str, Rows] = {}  # the requests whose rows are still coming
        self.num_requests = 0
        self.num_train_tokens = 0  # rows in `train` now
        self.num_new_tokens = 0  # training rows added since the trainer last took them
        self.num_seen_tokens = 0  # rows added, all time

    # -- draft thread ----------------------------------------------------------------------------
    def add(self, rid: str, new: bool, ids: list[int], features: torch.Tensor) -> None:
        """Rows of one extend; ``new``: the request starts (a replayed one starts afresh)."""
        with self.lock:
            rows = None if new else self.open.get(rid)
            if rows is None:
                rows = self.open[rid] = self._start()
                rows.first_output = len(ids) if new else 0
            added = rows.add(ids, features, self.dtype)
            self.num_seen_tokens += added
            if rows.limit is None and rows.key in self.train:
                self.num_train_tokens += added
                self.num_new_tokens += added
                self._evict()

    def close(self, rid: str) -> None:
        """``rid`` ends: no more rows; dropped when it has too few to learn from."""
        with self.lock:
            rows = self.open.pop(rid, None)
            if rows is not None and rows.num_tokens < self.settings.min_sequence_tokens:
                self._drop(rows)

    def _start(self) -> Rows:
        self.num_requests += 1
        s = self.settings
        if self.num_requests % s.heldout_every:
            rows = Rows(self.num_requests)
            self.train[rows.key] = rows
            return rows
        rows = Rows(self.num_requests, limit=s.heldout_sequence_tokens)
        self.recent.append(rows)
        if len(self.recent) > self.max_recent:
            self._offer(self.recent.popleft())
        return rows

    def _offer(self, rows: Rows) -> None:
        """Reservoir sampling (Algorithm R) over the held-out requests that leave `recent`."""
        self.num_offered += 1
        if len(self.reservoir) < self.max_reservoir:
            self.reservoir.append(rows)
            return
        slot = self.rng.randrange(self.num_offered)
        if slot < self.max_reservoir:
            self.reservoir[slot] = rows

    def _evict(self) -> None:
        while self.num_train_tokens > self.settings.train_tokens and self.train:
            _, rows = self.train.popitem(last=False)
            self.num_train_tokens -= rows.num_tokens
            self._forget_open(rows)

    def _drop(self, rows: Rows) -> None:
        if self.train.pop(rows.key, None) is not None:
            self.num_train_tokens -= rows.num_tokens
        elif rows in self.recent:
            self.recent.remove(rows)
        elif rows in self.reservoir:
            self.reservoir.remove(rows)

    def _forget_open(self, rows: Rows) -> None:
        for rid, held in list(self.open.items()):
            if held is rows:
                del self.open[rid]

    # -- trainer thread --------------------------------------------------------------------------
    def take_new(self) -> int:
        """Training rows added since the last call."""
        with self.lock:
            new, self.num_new_tokens = self.num_new_tokens, 0
            return new

    def windows(self, count: int, length: int) -> list[Window]:
        """``count`` windows of at most ``length`` consecutive rows of one training request,
        requests drawn by their row counts, starts uniform."""
        with self.lock:
            pool = [r for r in self.train.values() if r.num_tokens >= 3]
            if not pool:
                return []
            picked = self.rng.choices(pool, weights=[r.num_tokens for r in pool], k=count)
            spans = []
            for rows in picked:
                start = self.rng.randrange(max(rows.num_tokens - length, 0) + 1)
                n = min(length, rows.num_tokens)
                spans.append((rows.chunks(), start, n, rows.first_output))
        return [cut(span) for span in spans]

    def heldout(self) -> list[Window]:
        """Every held-out request's rows (recent and reservoir), those of at least 3 rows."""
        with self.lock:
            held = [*self.recent, *self.reservoir]
            spans = [(r.chunks(), 0, r.num_tokens, r.first_output) for r in held]
        return [cut(span) for span in spans if span[2] >= 3]

    def sizes(self) -> tuple[int, int]:
        """(training rows, held-out rows) held now."""
        with self.lock:
            return self.num_train_tokens, sum(r.num_tokens for r in [*self.recent, *self.reservoir])
