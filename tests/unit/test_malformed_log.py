"""`MalformedLog`: one line per method per interval, the refusals kept quiet counted in the next
line (issue 54 #7: a peer sending bytes that do not parse cannot flood the log)."""

from __future__ import annotations

import logging

import pytest

from specmesh.rpc import malformed


def test_one_line_per_method_per_interval_counting_the_rest(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING)
    now = [100.0]
    monkeypatch.setattr(malformed.time, "monotonic", lambda: now[0])
    refusals = malformed.MalformedLog(interval_s=60.0)
    for _ in range(5):
        refusals.note("/s.S/Step", "ipv4:1.2.3.4:5", "the request does not parse")
    refusals.note("/s.S/GetInfo", "ipv4:1.2.3.4:5", "the request does not parse")
    now[0] += 61.0
    refusals.note("/s.S/Step", "ipv4:1.2.3.4:5", "the request does not parse")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and not any(r.exc_info for r in caplog.records)
    assert lines[0].startswith("/s.S/Step from ipv4:1.2.3.4:5 refused (INVALID_ARGUMENT)")
    assert lines[1].startswith("/s.S/GetInfo") and "more" not in lines[1]
    assert lines[2].endswith("(4 more since the last line)"), lines[2]
