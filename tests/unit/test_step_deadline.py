"""The adaptive draft deadline: a multiple of the draft's recent p99, between a floor and the
configured maximum."""

from __future__ import annotations

from specmesh.router.faults import StepDeadline


def test_deadline_is_the_maximum_until_enough_steps_were_seen() -> None:
    d = StepDeadline(max_s=10.0, floor_s=0.5, factor=4.0, min_samples=4)
    for _ in range(3):
        d.observe(0.2)
    assert d.seconds == 10.0
    d.observe(0.2)
    assert d.seconds == 0.8  # 4 x 0.2


def test_deadline_follows_the_p99_within_floor_and_maximum() -> None:
    d = StepDeadline(max_s=10.0, floor_s=0.5, factor=4.0, window=100, min_samples=1)
    for _ in range(100):
        d.observe(0.01)
    assert d.seconds == 0.5  # fast steps: the floor
    for _ in range(2):
        d.observe(1.0)  # 2 slow steps in 100: above the 99th percentile's rank
    assert d.seconds == 4.0
    for _ in range(100):
        d.observe(5.0)  # a draft that got slow for good: capped
    assert d.seconds == 10.0
