"""The fault report's accounting (`specmesh.bench.fault_report.summarize`): what counts as exact, as a
failure and as the client's own cancel, and the verdict a scenario gets from them. The report
itself runs end to end in tests/e2e/test_faults_bench.py."""

from __future__ import annotations

from specmesh.bench.fault_cluster import Outcome, Req
from specmesh.bench.fault_report import ScenarioResult, percentile, summarize

WANT = [7, 8, 9, 10]


class FixedOracle:
    def tokens(self, req: Req) -> list[int]:
        return WANT[: req.max_new_tokens]


def test_exact_failed_and_cancelled_requests_are_told_apart() -> None:
    reqs = [Req((5,), 4), Req((5,), 4), Req((5,), 4, cancel_after=1), Req((5,), 4), Req((6,), 4)]
    outcomes = [
        Outcome(WANT, latency_ms=10.0),  # finished, exact
        Outcome([7, 8, 9, 11], latency_ms=30.0),  # finished, one token wrong
        Outcome([7, 8], "CANCELLED"),  # the client's cancel, a prefix: exact
        Outcome([7], "CANCELLED"),  # cancelled by the server: a failure, but a prefix
        Outcome([8], "UNAVAILABLE"),  # failed, and not a prefix
    ]
    p = summarize(reqs, outcomes, FixedOracle())
    assert (p.num_requests, p.num_exact, p.num_cancelled) == (5, 3, 1)
    assert p.failures == {"CANCELLED": 1, "UNAVAILABLE": 1}
    assert (p.p50_ms, p.p99_ms) == (10.0, 30.0)  # finished requests only

    result = ScenarioResult("x", "", {"during": p}, {}, {"draft": "1 requests"}, 1.0)
    assert result.problems() == [
        "during: 2 not exact",
        "during: failed {'CANCELLED': 1, 'UNAVAILABLE': 1}",
        "held after: {'draft': '1 requests'}",
    ]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile([], 0.5)) == (
        50.0,
        99.0,
        0.0,
    )
