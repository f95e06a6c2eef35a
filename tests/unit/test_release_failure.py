"""A replica that fails to release a finished request does not leave its client waiting: the
request still ends with its last tokens, its places are freed (the engine serves the next
requests), and the failure is logged. In process, a release that raised once hung
`Engine.generate` for good: the round failed after the request had finished, so neither its
last chunk nor an error ever reached the stream."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]
BOUND_S = 120.0  # a hang fails the test instead of the suite


def test_a_failed_release_still_ends_the_request(tiny_dir: Path, oracle, monkeypatch, caplog):
    engine = Engine(tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
                    spec=SpecParams(3, 2, 4))  # fmt: skip
    release, failed = TargetRuntime.release, []

    def failing(self, rid):  # frees what it holds, then fails as a buggy release would
        release(self, rid)
        failed.append(rid)
        raise RuntimeError("release failed")

    monkeypatch.setattr(TargetRuntime, "release", failing)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.ERROR):
        for _ in range(2):  # the second run needs the places the first one's requests held
            results = _within(BOUND_S, engine.generate, PROMPTS, params)
            for prompt, res in zip(PROMPTS, results, strict=True):
                assert res.token_ids == oracle(tiny_dir / "target", prompt, 8)
    assert len(failed) == 2 * len(PROMPTS)
    assert "release failed" in caplog.text


def _within(seconds: float, fn, *args):
    """``fn(*args)`` on a daemon thread: a hang fails here, and the thread cannot hold the
    test process open."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"no answer within {seconds:.0f} s"
    return out[0]
