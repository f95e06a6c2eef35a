"""When pre-drafting pays: a measured trade, per batch size, that the draft service makes before
each pre-draft (`specmesh.draft_service.predraft`).

A pre-draft saves the round a whole draft step only when every request of the next batch hits
(the batch is answered as one), and it costs the round whatever part of it the next batch has to
wait for. Both are measured here, as exponential averages per batch-size bucket:

    saving = P(every request of a batch hits) x the time a batch that misses takes
    delay  = how long a batch, once it arrived, waited for the pre-draft before it ran

The next pre-draft for a batch of that size runs when the saving exceeds the delay. A bucket
that stopped pre-drafting tries again every ``PROBE_EVERY`` batches (its all-hit rate is only
measured while it pre-drafts). A batch of one request hits about as often as one request does; a
batch of eight almost never does, so at large batches pre-drafting turns itself off.
"""

from __future__ import annotations

import time

BUCKETS = (1, 2, 4, 8, 16)  # a batch of n falls in the first bucket >= n (the last beyond)
PROBE_EVERY = 32  # batches between two tries of a bucket that stopped pre-drafting
DECAY = 0.8  # weight of the past in each average


class PredraftBudget:
    def __init__(self) -> None:
        n = len(BUCKETS)
        # Before any measurement: as if each request hit half the time (a batch of 8 then
        # almost never does); the first batch of a bucket pre-drafts to measure
        self.all_hit = [0.5**size for size in BUCKETS]
        self.miss_s = [0.0] * n  # time of a batch that missed (extend + propose)
        self.delay_s = [0.0] * n  # wait a batch had behind the pre-draft
        self.skipped = [0] * n  # batches since the bucket last pre-drafted
        self.arrived_s: float | None = None  # when the latest batch arrived at the service
        self.post_end_s: float | None = None  # when the latest pre-draft ended

    def arrived(self, now_s: float | None = None) -> None:
        """A batch arrived (the service's event loop calls this before queueing it)."""
        self.arrived_s = time.perf_counter() if now_s is None else now_s

    def observe(self, batch_size: int, all_hit: bool, step_s: float) -> None:
        """A batch ran: whether every request hit an outcome (only meaningful for a batch
        pre-drafted for), how long its step took, and how long it waited for the pre-draft."""
        b = _bucket(batch_size)
        if self.post_end_s is not None and self.arrived_s is not None:
            waited = max(0.0, self.post_end_s - self.arrived_s)
            self.delay_s[b] = DECAY * self.delay_s[b] + (1 - DECAY) * waited
            self.all_hit[b] = DECAY * self.all_hit[b] + (1 - DECAY) * all_hit
        if not all_hit:
            self.miss_s[b] = DECAY * self.miss_s[b] + (1 - DECAY) * step_s
        self.post_end_s = None

    def allows(self, batch_size: int) -> bool:
        """Whether to pre-draft for the batch that just ran (its requests' next extends)."""
        b = _bucket(batch_size)
        first = self.miss_s[b] == 0.0  # nothing measured yet
        if (
            first
            or self.all_hit[b] * self.miss_s[b] > self.delay_s[b]
            or self.skipped[b] >= PROBE_EVERY
        ):
            self.skipped[b] = 0
            return True
        self.skipped[b] += 1
        return False

    def pre_drafted(self) -> None:
        """The pre-draft just ended (the next batch's wait behind it is measured from here)."""
        self.post_end_s = time.perf_counter()


def _bucket(batch_size: int) -> int:
    return next((i for i, n in enumerate(BUCKETS) if batch_size <= n), len(BUCKETS) - 1)
